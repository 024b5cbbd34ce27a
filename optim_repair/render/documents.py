"""The JSON documents: one ``TypedDict`` per document, with a ``schema_version``, written by ``json.dumps``.

JSON never passes through rich. Fields are only added within a schema version; docs/json.md lists them.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterable, Mapping
from typing import TypedDict

from optim_repair.api import DryRun, FixResult
from optim_repair.decisions.census import StepCensus
from optim_repair.decisions.comparison import ModelComparison
from optim_repair.decisions.diagnose import Diagnosis, OptimizerDiagnosis
from optim_repair.decisions.notices import Notice
from optim_repair.records.inventory import ParamKey, Scalar
from optim_repair.records.traffic import Traffic
from optim_repair.records.verification import PINNED, UPLOADED, Verification
from optim_repair.render.differences import DiffDoc, FileDoc, diff_document, file_docs
from optim_repair.render.schema import SCHEMA_VERSION, VersionsDoc, versions_doc


class MalformedDoc(TypedDict):
    param: ParamKey | None
    code: str
    detail: str


class NoticeDoc(TypedDict):
    code: str
    severity: str
    detail: str


class ShapeMismatchDoc(TypedDict):
    param: str
    key: str
    state_shape: list[int]
    model_shape: list[int]


class ModelDoc(TypedDict):
    sources: list[str]
    by_index: bool
    optimizer_params: int
    model_params: int
    not_in_model: list[ParamKey]
    not_in_optimizer: list[str]
    shape_mismatches: list[ShapeMismatchDoc]
    rename: str | None


class StepDoc(TypedDict):
    param: ParamKey
    step: int | float


class CensusDoc(TypedDict):
    largest: int | float
    distribution: list[list[int | float]]
    steps: list[StepDoc]
    lagging: list[StepDoc]


class OptionDoc(TypedDict):
    group: int
    key: str


class AddedOptionDoc(TypedDict):
    file: str
    location: str
    group: int
    key: str
    value: Scalar


class OptimizerDoc(TypedDict):
    file: str
    location: str
    key_style: str
    layout: str
    loader: str
    resumes_as_is: bool
    groups: int
    params: int
    states: int
    missing: list[ParamKey]
    missing_options: list[OptionDoc]
    empty: list[ParamKey]
    malformed: list[MalformedDoc]
    notices: list[NoticeDoc]
    cold: bool
    model: ModelDoc | None
    census: CensusDoc | None


class SkippedDoc(TypedDict):
    file: str
    kind: str
    reason: str


class RemoteDoc(TypedDict):
    requests: int
    bytes_read: int
    bytes_written: int
    bytes_copied: int


class InspectDoc(TypedDict):
    schema_version: int
    versions: VersionsDoc
    path: str
    format: str
    verdict: str
    strict: bool
    optimizers: list[OptimizerDoc]
    notices: list[NoticeDoc]
    skipped: list[SkippedDoc]
    remote: RemoteDoc | None


class AddedDoc(TypedDict):
    file: str
    location: str
    param: ParamKey
    keys: list[str]
    dtypes: dict[str, str]
    replaced: bool
    group: int | None


class ChangedDoc(TypedDict):
    file: str
    location: str
    old: ParamKey
    new: ParamKey | None


class VerificationDoc(TypedDict):
    tensors: int
    bytes: int
    linked: list[str]
    proof: str


class ErrorDetailDoc(TypedDict):
    code: str
    exit_code: int
    message: str
    path: str | None


class ErrorDoc(TypedDict):
    schema_version: int
    error: ErrorDetailDoc


class PlannedDoc(InspectDoc):
    out: str
    fill: str
    fill_notes: list[str]
    changed: list[ChangedDoc]
    added: list[AddedDoc]
    added_options: list[AddedOptionDoc]
    older_forms: list[str]


class FixDoc(PlannedDoc):
    verification: VerificationDoc
    files: list[FileDoc]
    seconds: float
    diff: DiffDoc


class DryRunDoc(PlannedDoc):
    dry_run: bool
    bytes_to_write: int
    free_bytes: int | None


def _notice_docs(notices: Iterable[Notice]) -> list[NoticeDoc]:
    return [{"code": n.code, "severity": n.severity, "detail": n.detail} for n in notices]


def _model_doc(found: ModelComparison | None) -> ModelDoc | None:
    if found is None:
        return None
    return {
        "sources": list(found.sources),
        "by_index": found.by_index,
        "optimizer_params": found.optimizer_params,
        "model_params": found.model_params,
        "not_in_model": list(found.not_in_model),
        "not_in_optimizer": list(found.not_in_optimizer),
        "shape_mismatches": [
            {"param": m.param, "key": m.key, "state_shape": list(m.state_shape), "model_shape": list(m.model_shape)}
            for m in found.shape_mismatches
        ],
        "rename": None if found.rename is None else str(found.rename),
    }


def _optimizer_doc(opt: OptimizerDiagnosis) -> OptimizerDoc:
    return {
        "file": opt.file,
        "location": opt.location,
        "key_style": opt.key_style,
        "layout": opt.layout,
        "loader": opt.loader,
        "resumes_as_is": opt.resumes_as_is,
        "groups": opt.groups,
        "params": opt.params,
        "states": opt.states,
        "missing": list(opt.missing),
        "missing_options": [{"group": group, "key": key} for group, key in opt.missing_options],
        "empty": list(opt.empty),
        "malformed": [{"param": m.param, "code": m.code, "detail": m.detail} for m in opt.malformed],
        "notices": _notice_docs(opt.notices),
        "cold": opt.cold,
        "model": _model_doc(opt.model),
        "census": _census_doc(opt.census),
    }


def _census_doc(census: StepCensus | None) -> CensusDoc | None:
    if census is None:
        return None
    return {
        "largest": census.largest,
        "distribution": [[step, count] for step, count in census.distribution],
        "steps": [{"param": param, "step": step} for param, step in census.steps],
        "lagging": [{"param": param, "step": step} for param, step in census.lagging],
    }


def inspect_document(diagnosis: Diagnosis) -> InspectDoc:
    inventory = diagnosis.inventory
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": versions_doc(),
        "path": inventory.path,
        "format": inventory.format,
        "verdict": diagnosis.verdict,
        "strict": diagnosis.strict,
        "optimizers": [_optimizer_doc(opt) for opt in diagnosis.optimizers],
        "notices": _notice_docs(diagnosis.notices),
        "skipped": [{"file": s.file, "kind": s.kind, "reason": s.reason} for s in inventory.skipped],
        "remote": _remote_doc(inventory.traffic),
    }


def _remote_doc(traffic: Traffic | None) -> RemoteDoc | None:
    if traffic is None:
        return None
    return {
        "requests": traffic.requests, "bytes_read": traffic.read, "bytes_written": traffic.written,
        "bytes_copied": traffic.copied,
    }  # fmt: skip


def _added_docs(result: FixResult | DryRun) -> list[AddedDoc]:
    return [
        {"file": a.file, "location": a.location, "param": a.param, "keys": list(a.keys), "dtypes": dict(a.dtypes),
         "replaced": a.replaces, "group": a.group}
        for a in result.plan.additions
    ]  # fmt: skip


def _changed_docs(result: FixResult | DryRun) -> list[ChangedDoc]:
    return [{"file": c.file, "location": c.location, "old": c.old, "new": c.new} for c in result.plan.changes]


def _planned_document(result: FixResult | DryRun) -> PlannedDoc:
    """What ``fix`` and its dry run both report: the input, and what the plan changes and adds where."""
    return {
        **inspect_document(result.diagnosis),
        "out": str(result.out),
        "fill": result.plan.fill,
        "fill_notes": list(result.plan.fill_notes),
        "changed": _changed_docs(result),
        "added": _added_docs(result),
        "added_options": [
            {"file": o.file, "location": o.location, "group": o.group, "key": o.key, "value": o.value}
            for o in result.plan.options
        ],
        "older_forms": list(result.plan.older_forms),
    }


def fix_document(result: FixResult) -> FixDoc:
    return {
        **_planned_document(result),
        "remote": _remote_doc(result.traffic),
        "verification": {
            "tensors": result.verification.tensors,
            "bytes": result.verification.bytes,
            "linked": list(result.verification.linked),
            "proof": proof(result.verification),
        },
        "files": file_docs(result.files),
        "seconds": round(result.seconds, 3),
        "diff": diff_document(result.difference),
    }


def proof(verification: Verification) -> str:
    """How the copy was proven, in words: every byte read back, or how a store's copies were."""
    if verification.proof is None:
        return "read back through the file system"
    if verification.proof == "read back":
        return "read back from the store"
    if verification.proof.startswith(UPLOADED):
        checked_by = verification.proof[len(UPLOADED) :]
        return f"read back through the file system, then uploaded, each object checked by {checked_by} on receipt"
    if verification.proof.startswith(PINNED):
        return f"copied inside the store {verification.proof}, not proven (--verify download reads the copies back)"
    return f"verified by {verification.proof}, not read back"


def dry_run_document(planned: DryRun) -> DryRunDoc:
    return {
        **_planned_document(planned),
        "dry_run": True,
        "bytes_to_write": planned.bytes_to_write,
        "free_bytes": planned.free_bytes,
    }


def print_json(document: Mapping[str, object]) -> None:
    # ASCII, every string UTF-8 text (``_text``), and never NaN, which JSON does not have.
    sys.stdout.write(json.dumps(_as_text(document, top=True), indent=2, allow_nan=False) + "\n")


FILE_NAMES = frozenset({"path", "file", "out", "file_a", "file_b", "sources", "linked", "older_forms"})
"""The fields that hold a file name, or a list of them: each gets its bytes beside it where one is no UTF-8 text
(``<field>_bytes``). At a document's top, the diff's ``a`` and ``b`` are file names too."""
_TOP_FILE_NAMES = FILE_NAMES | {"a", "b"}


def _as_text(value: object, *, top: bool = False) -> object:
    """``value`` with every string made UTF-8 text (``_text``), and beside each file name that is not (a name on
    disk whose bytes do not decode, which Python holds as lone surrogates) its bytes, base64, as ``<field>_bytes``."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    if not isinstance(value, Mapping):
        return value
    names = _TOP_FILE_NAMES if top else FILE_NAMES
    shown: dict[str, object] = {}
    for key, item in value.items():
        shown[key] = _as_text(item)
        exact = _name_bytes(item) if key in names else None
        if exact is not None:
            shown[f"{key}_bytes"] = exact
    return shown


def _text(value: str) -> str:
    r"""``value`` where it is UTF-8 text; else each byte of a name that is no UTF-8 (Python's surrogate escape,
    U+DC80 to U+DCFF) written ``\xNN``, and any other lone surrogate ``\uNNNN``, so that every JSON reader takes it."""
    if value.isascii() or _is_text(value):
        return value
    return "".join(map(_escaped_surrogate, value))


def _escaped_surrogate(character: str) -> str:
    code = ord(character)
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}" if 0xD800 <= code <= 0xDFFF else character


def _is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _name_bytes(value: object) -> object:
    """A file name's bytes, base64, where it is no UTF-8 text (a list of names: each one's, ``None`` for those
    that are), or ``None`` where every name is."""
    if isinstance(value, str):
        return None if value.isascii() or _is_text(value) else base64.b64encode(_encoded(value)).decode("ascii")
    if isinstance(value, list) and any(isinstance(name, str) and not _is_text(name) for name in value):
        return [_name_bytes(name) for name in value]
    return None


def _encoded(name: str) -> bytes:
    """The bytes a name stands for: a file name's undecodable bytes are surrogate escapes; anything else (a lone
    surrogate a pickle spelled) its UTF-8 form as Python's ``surrogatepass`` writes it."""
    try:
        return name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogatepass")


def error_document(code: str, exit_code: int, message: str, path: str | None) -> ErrorDoc:
    return {
        "schema_version": SCHEMA_VERSION,
        "error": {"code": code, "exit_code": exit_code, "message": message, "path": path},
    }
