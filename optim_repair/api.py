"""The library's front door: what the CLI calls, and what training code can call directly."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from optim_repair.checkpoint import remote_reading, remote_writing
from optim_repair.checkpoint.discovery import Discovery, discover, latest_step
from optim_repair.checkpoint.planning import FinishedPlan, finish_plan
from optim_repair.checkpoint.reading import read_model_weights, read_parsed
from optim_repair.checkpoint.staging import remove_stale, taken_back_on_failure, temporary_sibling
from optim_repair.checkpoint.writing import free_space, space_needed, write_copy
from optim_repair.decisions.diagnose import Diagnosis, diagnose
from optim_repair.decisions.repair import plan_repair
from optim_repair.errors import InputError, Remedy, UsageError
from optim_repair.formats.planned import Parsed
from optim_repair.progress import Notice, Progress, Reporter, ignore, silent
from optim_repair.records.inventory import CheckpointInventory, WeightMap
from optim_repair.records.repair_plan import Addition, Fill, PlanFill, RepairPlan
from optim_repair.records.request import NO_OPERATIONS, CopyRequest, Operations, PlanRequest
from optim_repair.records.traffic import Traffic
from optim_repair.records.verification import Verification
from optim_repair.storage.names import is_s3


def inspect(
    path: str | Path,
    *,
    strict: bool = False,
    model: str | Path | None = None,
    dereference: bool = False,
    profile: str | None = None,
    endpoint_url: str | None = None,
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
    extra), read with the AWS CLI's credentials and endpoint, or ``profile`` and ``endpoint_url``; of it, only each
    DCP checkpoint's ``.metadata`` and bytes entries are read (``inventory.traffic`` counts the requests).
    """
    weights = _model_weights(model, RemoteOptions(profile, endpoint_url)) if model is not None else None
    if is_s3(path):
        with remote_reading.opened(str(path), profile=profile, endpoint_url=endpoint_url) as stored:
            inventory = stored.read(keep=False)[0]
            return diagnose(replace(inventory, traffic=stored.store.traffic()), strict=strict, model=weights)
    found = discover(Path(path), dereference=dereference)
    inventory, _ = _read_unchanged(found, keep=False)
    return diagnose(inventory, strict=strict, model=weights)


def _read_unchanged(found: Discovery, *, keep: bool = True) -> tuple[CheckpointInventory, Parsed]:
    """What reading found (``keep``: and kept for a writer), about one version of the checkpoint: a change while
    it was read (a run still saving it) is reported as that, also when it made a file look damaged."""
    try:
        read = read_parsed(found, keep=keep)
    except InputError:
        found.check_unchanged()
        raise
    found.check_unchanged()
    return read


def latest_checkpoint(run: str | Path, *, profile: str | None = None, endpoint_url: str | None = None) -> Path | str:
    """The newest complete step of the run directory ``run`` (``checkpoint-N``, ``step-N``, ``global_stepN``,
    ``epoch=E-step=S.ckpt``), to inspect or fix: a step still being written (a DCP checkpoint without its
    ``.metadata``, an empty directory, a prefix a repair is still writing) is passed over. ``run`` may be a
    prefix in a store (``"s3://bucket/run/"``): its step is returned as a URL. Raises ``InputError`` when there
    is none."""
    if is_s3(run):
        return remote_reading.latest_step(str(run), profile=profile, endpoint_url=endpoint_url)
    return latest_step(Path(run))


def compare(checkpoint: str | Path, model: str | Path) -> Diagnosis:
    """``inspect`` with ``model``: every optimizer compared with that model (``OptimizerDiagnosis.model``)."""
    return inspect(checkpoint, model=model)


def plan(
    checkpoint: str | Path | Diagnosis,
    *,
    fill: Fill | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    reset_phantom_step: bool = False,
    operations: Operations = NO_OPERATIONS,
    dereference: bool = False,
) -> RepairPlan:
    """What ``fix`` would add, and with what, without writing anything (a dry run).

    ``checkpoint`` is a path, or the ``Diagnosis`` that ``inspect`` returned for it. The plan is finished
    in every file's format as ``fix`` finishes it, so that it raises ``RepairRefused`` (or ``InputError``)
    for everything ``fix`` would refuse.
    """
    request = _request(fill, optimizer, model, reset_phantom_step, operations)
    read = _read(checkpoint, dereference)
    weights = _weights_of(request, RemoteOptions())
    return _finished(read.diagnosis, read.found.target, read.parsed, request, weights).plan


def _remote(checkpoint: str | Path | Diagnosis) -> bool:
    return is_s3(checkpoint.path if isinstance(checkpoint, Diagnosis) else checkpoint)


def _request(
    fill: Fill | None, optimizer: str | None, model: str | Path | None, reset_phantom_step: bool, operations: Operations
) -> PlanRequest:
    model_path = model if model is None or is_s3(model) else Path(model)
    return PlanRequest(fill, optimizer, model_path, reset_phantom_step, operations)


@dataclass(frozen=True)
class _Read:
    """A checkpoint as read for a repair: its diagnosis, what discovery found, and what reading parsed."""

    diagnosis: Diagnosis
    found: Discovery
    parsed: Parsed


def _read(checkpoint: str | Path | Diagnosis, dereference: bool) -> _Read:
    """The checkpoint's diagnosis (the one given, or read once) and what discovery found and reading parsed;
    ``dereference``: every link followed. A diagnosis is found again as its inspect found it."""
    if isinstance(checkpoint, Diagnosis):
        inventory = checkpoint.inventory
        if dereference and not inventory.dereference:
            raise UsageError(
                "{argument} is decided when the checkpoint is read: pass it to inspect", argument="dereference"
            )
        return _Read(checkpoint, discover(Path(inventory.path), dereference=inventory.dereference), Parsed())
    found = discover(Path(checkpoint), dereference=dereference)
    inventory, parsed = _read_unchanged(found)
    return _Read(diagnose(inventory), found, parsed)


def _model_weights(model: str | Path, remote: RemoteOptions) -> tuple[WeightMap, ...]:
    """The weights of ``model``: a local file or directory, or an object or prefix in a store."""
    if not is_s3(model):
        return read_model_weights(Path(model))
    with remote_reading.opened(str(model), profile=remote.profile, endpoint_url=remote.endpoint_url) as stored:
        return stored.weights()


def _weights_of(request: PlanRequest, remote: RemoteOptions) -> tuple[WeightMap, ...]:
    """The weights of the model ``request`` names (none when it names none), read once for a whole run."""
    return _model_weights(request.model, remote) if request.model is not None else ()


def _finished(
    diagnosis: Diagnosis, target: Path, parsed: Parsed, request: PlanRequest, weights: tuple[WeightMap, ...]
) -> FinishedPlan:
    """The repair plan ``request`` asks for, with the model's ``weights``, finished in every file's format (each
    refusal raised) as read under ``target``."""
    repair = plan_repair(
        diagnosis, request.fill, optimizer=request.optimizer, model_weights=weights,
        reset_phantom_step=request.reset_phantom_step, operations=request.operations,
    )  # fmt: skip
    return finish_plan(target, diagnosis.inventory, repair, parsed)


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
class RemoteOptions:
    """How to reach object storage: an AWS profile and an endpoint, each None for the AWS CLI's own choice."""

    profile: str | None = None
    endpoint_url: str | None = None


def _fixed_downloaded(
    stored: remote_reading.RemoteCheckpoint,
    diagnosis: Diagnosis,
    out: str | Path,
    request: PlanRequest,
    weights: tuple[WeightMap, ...],
    copy: CopyRequest,
    reporter: Reporter,
) -> FixResult:
    """``fix`` of a checkpoint in a store into a local ``out``: downloaded beside it (``remote_reading.downloaded``)
    and repaired from there as a local checkpoint, every unchanged file hard-linked."""
    target = stored.local_target(out)
    with stored.downloaded(target, force=copy.force, reporter=reporter) as local:
        read = _read(local, False)
        finished = _finished(read.diagnosis, read.found.target, read.parsed, request, weights)
        verification = write_copy(read.found, finished, target, copy, reporter)
    return FixResult(diagnosis, finished.plan, target, verification, stored.store.traffic())


@contextlib.contextmanager
def _planned_in_store(
    checkpoint: str | Path | Diagnosis, request: PlanRequest, weights: tuple[WeightMap, ...], remote: RemoteOptions
) -> Iterator[tuple[remote_reading.RemoteCheckpoint, Diagnosis, FinishedPlan]]:
    """A checkpoint in a store, read once, diagnosed, and its repair planned in every file's format (each refusal
    raised before a byte moves), while it is open."""
    path = checkpoint.path if isinstance(checkpoint, Diagnosis) else str(checkpoint)
    with remote_reading.opened(path, profile=remote.profile, endpoint_url=remote.endpoint_url) as stored:
        inventory, parsed = stored.read(keep=True)
        diagnosis = diagnose(inventory)
        yield stored, diagnosis, _finished(diagnosis, stored.mirror, parsed, request, weights)


def _upload_key(found: Discovery, out: str) -> str:
    """Where a local checkpoint goes in a store: ``out``, or for a file and an ``out`` ending in a slash, the
    file's name under it, as ``cp`` does."""
    return f"{out}{found.root.name}" if out.endswith("/") and not found.is_directory else out


def _fixed_uploaded(
    checkpoint: str | Path | Diagnosis,
    out: str,
    request: PlanRequest,
    weights: tuple[WeightMap, ...],
    force: bool,
    dereference: bool,
    remote: RemoteOptions,
    reporter: Reporter,
) -> FixResult:
    """``fix`` of a local checkpoint into a store: repaired into a temporary directory under ``TMPDIR`` (unchanged
    files hard-linked where it shares the checkpoint's file system, not synced; locked while the run lives, and
    removed by the next run after a kill), proven there, then uploaded (``remote_writing.upload_copy``). The
    checkpoint's own directory is never written to."""
    read = _read(checkpoint, dereference)
    finished = _finished(read.diagnosis, read.found.target, read.parsed, request, weights)
    key = _upload_key(read.found, out)
    private = Path(tempfile.gettempdir()) / "optim-repair-upload"  # the stand-in its temporaries are named for
    remove_stale(private, reporter.notice)  # what a killed upload left
    with temporary_sibling(private, directory=True) as tmp:
        staged = tmp / read.found.root.name
        link = os.stat(tmp).st_dev == os.stat(read.found.target).st_dev
        with taken_back_on_failure():  # the staged copy is this run's own, never a copy the user was given
            verification = write_copy(read.found, finished, staged, CopyRequest(link=link, sync=False), reporter)
        traffic = remote_writing.upload_copy(
            staged, key, force=force, profile=remote.profile, endpoint_url=remote.endpoint_url, reporter=reporter
        )
    return FixResult(read.diagnosis, finished.plan, key, replace(verification, proof="upload"), traffic)


def output_path(checkpoint: Path, out: str | Path) -> Path:
    """Where ``fix`` writes: ``out``, or, for a file and an ``out`` ending in a slash, the file's name inside
    that directory, as ``cp`` does."""
    text = os.fspath(out)
    if text.endswith(("/", os.sep)) and not checkpoint.is_dir():
        return Path(text) / checkpoint.name
    return Path(text)


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
    fill: Fill | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    link: bool = False,
    dereference: bool = False,
    reset_phantom_step: bool = False,
    operations: Operations = NO_OPERATIONS,
    profile: str | None = None,
    endpoint_url: str | None = None,
) -> DryRun:
    """What ``fix`` with the same arguments would add and write, and the room there is for it; writes nothing.
    Either side may be in a store, as for ``fix``."""
    request = _request(fill, optimizer, model, reset_phantom_step, operations)
    remote = RemoteOptions(profile, endpoint_url)
    weights = _weights_of(request, remote)
    if _remote(checkpoint):
        with _planned_in_store(checkpoint, request, weights, remote) as (stored, diagnosis, finished):
            needed = sum(item.size for item in stored.listing.values()) + finished.added_bytes()
            target: Path | str = os.fspath(out) if is_s3(out) else stored.local_target(out)
        free = None if isinstance(target, str) else free_space(target)
        return DryRun(diagnosis, finished.plan, target, needed, free)
    read = _read(checkpoint, dereference)
    finished = _finished(read.diagnosis, read.found.target, read.parsed, request, weights)
    if is_s3(out):
        needed = space_needed(read.found, finished, link=False)
        return DryRun(read.diagnosis, finished.plan, _upload_key(read.found, os.fspath(out)), needed, None)
    local = output_path(read.found.root, out)
    needed = space_needed(read.found, finished, link=link)
    return DryRun(read.diagnosis, finished.plan, local, needed, free_space(local))


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

    @property
    def fill(self) -> PlanFill:
        return self.plan.fill

    @property
    def added(self) -> tuple[Addition, ...]:
        return self.plan.additions


def fix(
    checkpoint: str | Path | Diagnosis,
    out: str | Path,
    *,
    fill: Fill | None = None,
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
    profile: str | None = None,
    endpoint_url: str | None = None,
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
    """
    request = _request(fill, optimizer, model, reset_phantom_step, operations)
    reporter = Reporter(progress, notice)
    remote = RemoteOptions(profile, endpoint_url)
    if verify == "download" and not (_remote(checkpoint) and is_s3(out)):
        raise UsageError("{argument} is for copies made inside a store (s3:// to s3://)", argument="verify")
    weights = _weights_of(request, remote)
    if _remote(checkpoint):
        with _planned_in_store(checkpoint, request, weights, remote) as (stored, diagnosis, finished):
            if not is_s3(out):
                local = CopyRequest(force=force, link=True, sync=sync)
                return _fixed_downloaded(stored, diagnosis, out, request, weights, local, reporter)
            verification, traffic = remote_writing.write_remote(
                stored, finished, os.fspath(out), force=force, read_back=verify == "download", reporter=reporter
            )
        return FixResult(diagnosis, finished.plan, os.fspath(out), verification, traffic)
    if is_s3(out):
        return _fixed_uploaded(checkpoint, os.fspath(out), request, weights, force, dereference, remote, reporter)
    read = _read(checkpoint, dereference)
    finished = _finished(read.diagnosis, read.found.target, read.parsed, request, weights)
    target = output_path(read.found.root, out)
    copy = CopyRequest(force=force, link=link, sync=sync)
    verification = write_copy(read.found, finished, target, copy, Reporter(progress, notice))
    return FixResult(read.diagnosis, finished.plan, target, verification)
