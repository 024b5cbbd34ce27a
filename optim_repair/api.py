"""The library's front door: what the CLI calls, and what training code can call directly."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from optim_repair.checkpoint import copies, stored
from optim_repair.checkpoint.diffing import diff_listings
from optim_repair.checkpoint.discovery import discover, latest_step
from optim_repair.checkpoint.file_changes import copy_changes
from optim_repair.checkpoint.planning import FinishedPlan, finish_plan
from optim_repair.checkpoint.reading import DiskListing, Listing, disk_model, model_weights, read_parsed
from optim_repair.checkpoint.trackers import tracker_disagrees
from optim_repair.decisions.diagnose import Diagnosis, diagnose
from optim_repair.decisions.difference import repair_difference
from optim_repair.decisions.repair import plan_repair
from optim_repair.errors import InputError, Remedy, UsageError
from optim_repair.formats.planned import Parsed
from optim_repair.progress import Notice, Progress, Reporter, ignore, silent
from optim_repair.records.difference import Difference, FileChange, LeafTally
from optim_repair.records.inventory import CheckpointInventory, WeightMap
from optim_repair.records.repair_plan import Addition, FillChoice, PlanFill, RepairPlan
from optim_repair.records.request import NO_OPERATIONS, CopyRequest, Operations, PlanRequest
from optim_repair.records.traffic import Traffic
from optim_repair.records.verification import Verification
from optim_repair.storage.schemes import StoreArgs, StoreOptions, is_remote

if TYPE_CHECKING:
    from typing_extensions import Unpack


def inspect(
    path: str | Path,
    *,
    strict: bool = False,
    model: str | Path | None = None,
    dereference: bool = False,
    for_torch: str | None = None,
    **store: Unpack[StoreArgs],
) -> Diagnosis:
    """Read ``path`` (a torch file, a checkpoint directory or a DCP directory) and diagnose it.

    The verdict answers "will a resume through the loader this layout implies work, and continue
    exactly?": absent entries that ``optimizer.load_state_dict`` (index keys) resumes exactly leave it
    ``healthy``, unless ``strict``. Each optimizer is compared with ``model`` (a safetensors file or
    directory of shards, a torch file, a DCP directory), or with the weights beside it when there are
    some (``OptimizerDiagnosis.model``). Reads no tensor bytes (only ``step`` values); never unpickles
    unsafely. A symbolic link under ``path`` is read through when it reaches a regular file outside the
    checkpoint, and a linked directory is not walked; ``dereference`` follows every link (``cp -L``).
    Raises ``optim_repair.errors.InputError`` when there is nothing to inspect.

    ``path`` may be a prefix in object storage, as a string (``"s3://bucket/step-1000/"``: the ``optim-repair[s3]``
    extra, read with the AWS CLI's credentials and endpoint, or ``profile`` and ``endpoint_url``;
    ``"gs://bucket/step-1000/"``: the ``optim-repair[gcs]`` extra, with application default credentials, at
    ``endpoint_url`` or ``STORAGE_EMULATOR_HOST`` where given; ``"az://container/step-1000/"``: the
    ``optim-repair[azure]`` extra, in the ``account`` the URL, the argument or the connection string names); of it,
    only each DCP checkpoint's ``.metadata`` and bytes entries are read (``inventory.traffic`` counts the requests).

    ``for_torch`` (``"2.13"``) names the torch release that will load it, whose loaders judge it (the param-group
    options its ``dcp.load`` asks for); by default the installed torch.
    """
    options = StoreOptions(**store)
    weights = _model_weights(model, options) if model is not None else None
    with _listing(path, options, dereference=dereference) as listing:
        inventory, _ = _read_unchanged(listing, keep=False)
        found = replace(inventory, traffic=listing.traffic())
        return diagnose(found, strict=strict, model=weights, release=_release_of(for_torch))


@contextlib.contextmanager
def _listing(
    path: str | Path, options: StoreOptions, *, dereference: bool = False, mirror: Path | None = None
) -> Iterator[Listing]:
    """What one listing finds under the checkpoint argument ``path``: a local walk (``dereference``: every link
    followed), or one listing of a store (its objects fetched under ``mirror``), open for the block."""
    if is_remote(path):
        with stored.opened(str(path), options, mirror) as listing:
            yield listing
    else:
        yield DiskListing(discover(Path(path), dereference=dereference))


def _release_of(for_torch: str | None) -> tuple[int, int] | None:
    """The torch release ``for_torch`` names (``2.13``, ``2.13.0``, ``2.13.0+cu121``: (2, 13)); None for the
    installed torch."""
    if for_torch is None:
        return None
    found = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?(?:[+.\w-]*)", for_torch.strip())
    if found is None:
        raise UsageError(f"{{argument}} takes a torch release such as 2.13, not {for_torch!r}", argument="for_torch")
    return int(found[1]), int(found[2])


def _read_unchanged(listing: Listing, *, keep: bool = True) -> tuple[CheckpointInventory, Parsed]:
    """What reading found (``keep``: and kept for a writer), about one version of the checkpoint: a change while
    it was read (a run still saving it) is reported as that, also when it made a file look damaged."""
    try:
        read = read_parsed(listing, keep=keep)
    except InputError:
        listing.check_unchanged()
        raise
    listing.check_unchanged()
    return read


def latest_checkpoint(
    run: str | Path,
    *,
    notice: Notice = silent,
    **store: Unpack[StoreArgs],
) -> Path | str:
    """The newest complete step of the run directory ``run`` (``checkpoint-N``, ``step-N``, ``global_stepN``,
    ``iter_N``, ``epoch=E-step=S.ckpt``), to inspect or fix: a step still being written (a DCP checkpoint without
    its ``.metadata``, an HF Trainer step without its ``trainer_state.json``, an empty directory, a prefix a repair
    is still writing) is passed over. ``notice`` hears when the run's tracker (DeepSpeed's ``latest``, Megatron's
    ``latest_checkpointed_iteration.txt``) names another step. ``run`` may be a prefix in a store
    (``"s3://bucket/run/"``): its step is returned as a URL (its tracker is not read). Raises ``InputError`` when
    there is none."""
    if is_remote(run):
        return stored.latest_step(str(run), StoreOptions(**store))
    step = latest_step(Path(run))
    disagreeing = tracker_disagrees(Path(run), step)
    if disagreeing is not None:
        notice(disagreeing)
    return step


def diff(
    a: str | Path,
    b: str | Path,
    *,
    metadata_only: bool = False,
    **store: Unpack[StoreArgs],
) -> Difference:
    """Compare two checkpoints, each anything ``inspect`` reads (a torch file, a checkpoint directory, a DCP
    directory, a prefix in object storage), of one format or two.

    Optimizers are matched by where they sit and compared by what they hold (parameters, state entries, each
    ``step``, each group's hyperparameters); every tensor, value and file by name, tensors bit for bit (dtype,
    shape, strides, storage sharing, every byte: how many elements differ, by how much at most). A DCP checkpoint
    and the torch file ``dcp_to_torch_save`` makes of it hold the same. ``metadata_only`` reads no tensor bytes.
    Nothing is loaded with torch; bytes are read in bounded memory. ``Difference.same`` says whether they agree.
    """
    options = StoreOptions(**store)
    with _listing(a, options) as first, _listing(b, options) as second:
        return diff_listings(first, second, metadata_only=metadata_only)


def compare(checkpoint: str | Path, model: str | Path) -> Diagnosis:
    """``inspect`` with ``model``: every optimizer compared with that model (``OptimizerDiagnosis.model``)."""
    return inspect(checkpoint, model=model)


def plan(
    checkpoint: str | Path | Diagnosis,
    *,
    fill: FillChoice | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    reset_phantom_step: bool = False,
    operations: Operations = NO_OPERATIONS,
    dereference: bool = False,
    for_torch: str | None = None,
) -> RepairPlan:
    """What ``fix`` would add, and with what, without writing anything (a dry run).

    ``checkpoint`` is a path, or the ``Diagnosis`` that ``inspect`` returned for it. The plan is finished
    in every file's format as ``fix`` finishes it, so that it raises ``RepairRefused`` (or ``InputError``)
    for everything ``fix`` would refuse.
    """
    request = _request(fill, optimizer, model, reset_phantom_step, operations)
    weights = _weights_of(request, StoreOptions())
    with _opened(checkpoint, StoreOptions(), dereference, release=_release_of(for_torch)) as read:
        return _finished(read, request, weights).plan


def _path_of(checkpoint: str | Path | Diagnosis) -> str | Path:
    return checkpoint.path if isinstance(checkpoint, Diagnosis) else checkpoint


def _request(
    fill: FillChoice | None,
    optimizer: str | None,
    model: str | Path | None,
    reset_phantom_step: bool,
    operations: Operations,
) -> PlanRequest:
    model_path = model if model is None or is_remote(model) else Path(model)
    return PlanRequest(fill, optimizer, model_path, reset_phantom_step, operations)


@dataclass(frozen=True)
class _Read:
    """A checkpoint as read for a repair: its diagnosis, what its listing found, and what reading parsed."""

    diagnosis: Diagnosis
    listing: Listing
    parsed: Parsed


@contextlib.contextmanager
def _opened(
    checkpoint: str | Path | Diagnosis,
    options: StoreOptions,
    dereference: bool,
    mirror: Path | None = None,
    release: tuple[int, int] | None = None,
) -> Iterator[_Read]:
    """The checkpoint read once for a repair, on a disk or in a store (its objects fetched under ``mirror``):
    its diagnosis (a local one given is found again as its inspect found it, not read again), listing and what
    was parsed, open for the block; ``dereference``: every local link followed."""
    if isinstance(checkpoint, Diagnosis) and not is_remote(checkpoint.path):
        inventory = checkpoint.inventory
        if dereference and not inventory.dereference:
            raise UsageError(
                "{argument} is decided when the checkpoint is read: pass it to inspect", argument="dereference"
            )
        yield _Read(
            checkpoint, DiskListing(discover(Path(inventory.path), dereference=inventory.dereference)), Parsed()
        )
        return
    with _listing(_path_of(checkpoint), options, dereference=dereference, mirror=mirror) as listing:
        inventory, parsed = _read_unchanged(listing)
        yield _Read(diagnose(inventory, release=release), listing, parsed)


def _model_weights(model: str | Path, options: StoreOptions) -> tuple[WeightMap, ...]:
    """The weights of ``model``: a local file or directory, or an object or prefix in a store."""
    if not is_remote(model):
        return model_weights(disk_model(Path(model)))
    with stored.opened(str(model), options) as listing:
        return model_weights(listing)


def _weights_of(request: PlanRequest, options: StoreOptions) -> tuple[WeightMap, ...]:
    """The weights of the model ``request`` names (none when it names none), read once for a whole run."""
    return _model_weights(request.model, options) if request.model is not None else ()


def _finished(read: _Read, request: PlanRequest, weights: tuple[WeightMap, ...]) -> FinishedPlan:
    """The repair plan ``request`` asks for, with the model's ``weights``, finished in every file's format (each
    refusal raised) as read."""
    repair = plan_repair(
        read.diagnosis, request.fill, optimizer=request.optimizer, model_weights=weights,
        reset_phantom_step=request.reset_phantom_step, operations=request.operations,
    )  # fmt: skip
    return finish_plan(read.listing.local, read.diagnosis.inventory, repair, read.parsed)


def model_changes(
    *,
    rename: Sequence[tuple[str, str]] = (),
    drop: Sequence[str] = (),
    drop_not_in_model: bool = False,
    add_from_model: bool = False,
    to_group: int | None = None,
) -> Operations:
    """What ``fix`` changes when the model changed, applied in the order rename, drop, add: ``rename`` holds
    (regular expression, replacement) pairs applied to every parameter name in ``state`` and ``param_groups``;
    ``drop`` regular expressions remove matching parameters; ``drop_not_in_model`` removes the parameters the
    model lacks; ``add_from_model`` adds every model parameter no group holds to group ``to_group`` (the only
    group by default), filled like an absent entry."""
    if to_group is not None and not add_from_model:
        raise UsageError(
            "{argument} only says which group the model's added parameters join",
            argument="to_group",
            remedy=Remedy("add_from_model"),
        )
    return Operations(tuple(rename), tuple(drop), drop_not_in_model, add_from_model, to_group)


@dataclass(frozen=True)
class DryRun:
    """What ``fix`` would add and write, found without writing anything."""

    diagnosis: Diagnosis
    plan: RepairPlan
    out: Path | str
    """The copy: a path, or a URL in a store."""
    bytes_to_write: int
    """About how many bytes the copy would take (hard-linked files excluded)."""
    free_bytes: int | None
    """The bytes free on the file system that would hold ``out``; None in a store, which sets no such bound."""


def dry_run(
    checkpoint: str | Path | Diagnosis,
    out: str | Path,
    *,
    fill: FillChoice | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    link: bool = False,
    force: bool = False,
    dereference: bool = False,
    reset_phantom_step: bool = False,
    operations: Operations = NO_OPERATIONS,
    for_torch: str | None = None,
    **store: Unpack[StoreArgs],
) -> DryRun:
    """What ``fix`` with the same arguments would add and write, and the room there is for it; writes nothing
    (but a temporary beside ``out``, removed at once: the run's first write, tried). What ``fix`` would refuse
    before it writes (an ``out`` that exists, without ``force``; too little room; a directory it cannot write
    in) is refused alike. Either side may be in a store, as for ``fix``."""
    request = _request(fill, optimizer, model, reset_phantom_step, operations)
    options = StoreOptions(**store)
    weights = _weights_of(request, options)
    with _opened(checkpoint, options, dereference, release=_release_of(for_torch)) as read:
        finished = _finished(read, request, weights)
        target, needed, free = copies.estimate(read.listing, finished, out, link=link, force=force, options=options)
    return DryRun(read.diagnosis, finished.plan, target, needed, free)


@dataclass(frozen=True)
class FixResult:
    """What ``fix`` found, added, wrote and proved."""

    diagnosis: Diagnosis
    plan: RepairPlan
    out: Path | str
    """The copy: a path, or an ``s3://`` prefix."""
    verification: Verification
    traffic: Traffic | None = None
    """For a copy in object storage: the requests and bytes reading, copying and writing took."""
    files: tuple[FileChange, ...] = ()
    """Each file of a copy on a disk: rewritten, copied, hard-linked, downloaded or added (() for one in a store,
    whose ``traffic`` says what moved)."""
    seconds: float = 0.0
    """How long the fix took, reading to proof."""

    @property
    def fill(self) -> PlanFill:
        return self.plan.fill

    @property
    def added(self) -> tuple[Addition, ...]:
        return self.plan.additions

    @property
    def difference(self) -> Difference:
        """The copy as ``diff`` finds it against the original: what the plan added, renamed and dropped, the
        files as written, and what the proof compared (every original tensor identical)."""
        proven = LeafTally(tensors=self.verification.tensors, identical=self.verification.tensors,
                           bytes_compared=self.verification.bytes)  # fmt: skip
        found = repair_difference(self.diagnosis.inventory, self.plan, str(self.out), self.files, proven)
        return replace(found, seconds=self.seconds)


def fix(
    checkpoint: str | Path | Diagnosis,
    out: str | Path,
    *,
    fill: FillChoice | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    force: bool = False,
    link: bool = False,
    dereference: bool = False,
    sync: bool = True,
    reset_phantom_step: bool = False,
    operations: Operations = NO_OPERATIONS,
    progress: Progress = ignore,
    notice: Notice = silent,
    verify: Literal["store", "download"] = "store",
    for_torch: str | None = None,
    **store: Unpack[StoreArgs],
) -> FixResult:
    """Write a repaired copy of ``checkpoint`` to ``out``, verified as read back; the input is never modified.

    ``checkpoint`` is a path, or the ``Diagnosis`` that ``inspect`` returned for it (not read again).
    ``fill`` is ``"empty"`` (add ``{}``; the default for torch files) or ``"fresh"`` (the exact state
    the optimizer creates on a first step; the default for DCP). Raises an ``OptimRepairError``
    subclass, leaving nothing at ``out``, when the input is malformed or the copy cannot be made.
    ``link`` hard-links the files the repair does not change instead of copying them. A symbolic link
    stays a link, but one to a file the repair changes, which the copy holds as a regular file;
    ``dereference`` copies what every link reaches instead (``cp -L``). ``sync=False``
    skips syncing the copy to the disk (a scratch copy: a crash may lose it, never the input).
    ``progress`` hears of the bytes written and verified (``optim_repair.progress.Step``); ``notice``
    gets lines of text for the user. For a file, an ``out`` ending in a slash is a directory to write
    into. ``reset_phantom_step`` also replaces every entry with ``step`` 1 and all-zero moments (what
    torch's full-state loader gave a parameter without state) by what ``fill`` gives a parameter without
    state, once every byte of its moments is proven zero. ``operations`` (see ``model_changes()``) rename,
    drop and add parameters first, when the model changed. Refused up front when the file system holding
    ``out`` has too little room for the copy.

    A checkpoint in object storage (``"s3://bucket/step-1000/"``, see ``inspect``) is written to an empty prefix
    (``out``, ``"s3://..."``; ``force`` empties it first) by server-side copies and one new shard, each
    ``.metadata`` last; the copies are proven by the store's checksums, or with ``verify="download"`` read back.
    ``for_torch`` names the torch release that will load the copy, as for ``inspect``.
    """
    started = time.monotonic()
    request = _request(fill, optimizer, model, reset_phantom_step, operations)
    reporter = Reporter(progress, notice)
    options = StoreOptions(**store)
    source, release = _path_of(checkpoint), _release_of(for_torch)
    if verify == "download" and not (is_remote(source) and is_remote(out)):
        raise UsageError(
            "{argument} is for copies made inside a store (s3:// to s3://, gs:// to gs://, az:// to az://)",
            argument="verify",
        )
    weights = _weights_of(request, options)
    copy = CopyRequest(force=force, link=link, sync=sync, read_back=verify == "download")
    with contextlib.ExitStack() as held:
        mirror = None
        if is_remote(source) and not is_remote(out):  # its objects are fetched beside the copy, to link from
            mirror = held.enter_context(copies.mirror_beside(str(source), out, force=force, reporter=reporter))
        read = held.enter_context(_opened(checkpoint, options, dereference, mirror, release))
        finished = _finished(read, request, weights)
        written, verification, traffic = copies.write(read.listing, finished, out, copy, options, reporter)
        files = () if is_remote(written) else copy_changes(
            read.listing.local, Path(written), finished, downloaded=is_remote(source)
        )  # fmt: skip
    seconds = time.monotonic() - started
    return FixResult(read.diagnosis, finished.plan, written, verification, traffic, files, seconds)
