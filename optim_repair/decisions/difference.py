"""Two checkpoints side by side: their optimizers matched by where they sit, their leaves by name.

Optimizers compare by what they hold (parameters, state entries and their keys, each parameter's ``step``, each
group's hyperparameters); leaves by what they are (dtype, shape, strides, storage sharing, values). Whether the
bytes of two tensors agree is ``checkpoint.diffing``'s to read. Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from optim_repair.decisions.comparison import model_of, weights_beside
from optim_repair.decisions.optimizers import PARAM_SHAPED_KEYS
from optim_repair.errors import shown
from optim_repair.records.difference import (
    Difference,
    FileChange,
    LeafDifference,
    LeafTally,
    Movement,
    OptimizerDifference,
    OptionChange,
    StepChange,
)
from optim_repair.records.dtypes import itemsize
from optim_repair.records.inventory import CheckpointInventory, OptimizerInventory, ParamKey, TensorMeta
from optim_repair.records.keys import flat_key
from optim_repair.records.leaves import Leaf, LeafName, RawLeaf, TensorLeaf, ValueLeaf, leaf_text, path_part
from optim_repair.records.repair_plan import Addition, FreshTensor, GroupOption, ParamChange, RepairPlan

Values = dict[LeafName, float | int | bool | complex | None]
"""One-element tensors' values read from their bytes, by leaf (what a DCP checkpoint's inventory lacks)."""


def _matched(
    a: Sequence[OptimizerInventory], b: Sequence[OptimizerInventory]
) -> tuple[list[tuple[OptimizerInventory, OptimizerInventory]], list[OptimizerInventory], list[OptimizerInventory]]:
    """Pairs of optimizers at the same file and place; then at the same place in any file; then, where one is
    left on each side, those two (a DCP checkpoint's ``optim`` and the ``optimizer`` key of a torch file)."""
    left_a, left_b = list(a), list(b)
    pairs = []
    for same in (
        lambda x, y: (x.file, x.location) == (y.file, y.location),
        lambda x, y: x.location == y.location,
        lambda x, y: len(left_a) == len(left_b) == 1,
    ):
        for opt in list(left_a):
            twin = next((other for other in left_b if same(opt, other)), None)
            if twin is not None:
                pairs.append((opt, twin))
                left_a.remove(opt)
                left_b.remove(twin)
    return pairs, left_a, left_b


def _step_leaf(opt: OptimizerInventory, param: ParamKey) -> LeafName:
    if opt.layout == "flattened":
        tail: tuple[str, ...] = (flat_key("state", param, "step"),)
    else:
        tail = ("state", path_part(param), "step")
    file, address = opt.file, tuple(path_part(part) for part in opt.address)
    if address and address[0].endswith(".metadata"):  # a rank's own view: its leaves are under its file
        file, address = f"{file}/{address[0]}" if file else address[0], address[1:]
    return file, (*address, *tail)


def _step(opt: OptimizerInventory, param: ParamKey, values: Values) -> float | int | None:
    """A parameter's step: 0 for one without state, None where it was not read."""
    entry = opt.entry(param)
    if entry is None or not entry.is_mapping or "step" not in entry.keys:
        return 0
    value = entry.get("step")
    if isinstance(value, TensorMeta):
        value = value.value if value.value is not None else values.get(_step_leaf(opt, param))
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _movement(a: float | int | None, b: float | int | None) -> Movement:
    if a is None or b is None:
        return "unknown"
    return "advanced" if b > a else "went back" if b < a else "same"


def _option_text(value: object) -> str:
    if isinstance(value, TensorMeta):
        held = "" if value.value is None else f" = {shown(value.value)}"
        return f"tensor {value.dtype} {list(value.shape)}{held}"
    return shown(value)


def _options(a: OptimizerInventory, b: OptimizerInventory) -> list[OptionChange]:
    changes = []
    for index in range(max(len(a.groups), len(b.groups))):
        group_a = dict(a.groups[index].options) if index < len(a.groups) else {}
        group_b = dict(b.groups[index].options) if index < len(b.groups) else {}
        for key in dict.fromkeys([*group_a, *group_b]):
            text_a = _option_text(group_a[key]) if key in group_a else None
            text_b = _option_text(group_b[key]) if key in group_b else None
            if text_a != text_b:
                changes.append(OptionChange(index, key, text_a, text_b))
    return changes


def index_names(opt: OptimizerInventory, inventory: CheckpointInventory) -> dict[ParamKey, str]:
    """For an index-keyed optimizer, each index's name in the one model beside it, where that model lists its
    tensors in the model's order and has exactly a tensor a parameter (index ``i`` is the model's ``i``-th
    parameter); else none: a safetensors file's names are sorted, not in the model's order."""
    file = next((file for file in inventory.files if opt in file.optimizers), None)
    if opt.key_style != "index" or file is None:
        return {}
    models = model_of(opt, weights_beside(file, inventory))
    params = list(dict.fromkeys(opt.params))
    if len(models) != 1 or not models[0].in_model_order or len(models[0].tensors) != len(params):
        return {}
    if sorted(params) != list(range(len(params))):
        return {}
    tensors = models[0].tensors
    for entry in opt.entries:  # a buffer counted for a frozen parameter would shift the names: shapes tell
        for key, value in entry.values or ():
            if not (isinstance(value, TensorMeta) and key in PARAM_SHAPED_KEYS and entry.param in range(len(params))):
                continue
            if tensors[int(entry.param)][1].shape != value.shape:
                return {}
    return {index: tensors[index][0] for index in range(len(params))}


def optimizer_difference(
    a: OptimizerInventory,
    b: OptimizerInventory,
    values_a: Values,
    values_b: Values,
    names: tuple[dict[ParamKey, str], dict[ParamKey, str]] = ({}, {}),
) -> OptimizerDifference:
    """What differs between two optimizers, parameters matched by key (names, or indices; where one side is
    keyed by index and the other by name, its indices by the ``names`` its model gives them)."""
    params_a = {names[0].get(p, str(p)): p for p in a.params}
    params_b = {names[1].get(p, str(p)): p for p in b.params}
    appeared: list[str] = []
    vanished: list[str] = []
    keys_appeared: list[tuple[str, str]] = []
    keys_vanished: list[tuple[str, str]] = []
    steps: list[StepChange] = []
    stepped = any("step" in entry.keys for opt in (a, b) for entry in opt.entries)
    for name in (name for name in params_a if name in params_b):
        entry_a, entry_b = a.entry(params_a[name]), b.entry(params_b[name])
        if entry_a is None and entry_b is not None:
            appeared.append(name)
        elif entry_b is None and entry_a is not None:
            vanished.append(name)
        keys_a, keys_b = (entry.keys if entry else () for entry in (entry_a, entry_b))
        if entry_a is not None and entry_b is not None:
            keys_appeared.extend((name, key) for key in keys_b if key not in keys_a)
            keys_vanished.extend((name, key) for key in keys_a if key not in keys_b)
        if stepped:  # a parameter without state is at step 0
            step_a, step_b = _step(a, params_a[name], values_a), _step(b, params_b[name], values_b)
            steps.append(StepChange(name, step_a, step_b, _movement(step_a, step_b)))
    return OptimizerDifference(
        location=b.location if a.location == b.location else f"{a.location} / {b.location}",
        file_a=a.file,
        file_b=b.file,
        only_in_a=tuple(name for name in params_a if name not in params_b),
        only_in_b=tuple(name for name in params_b if name not in params_a),
        appeared=tuple(appeared),
        vanished=tuple(vanished),
        keys_appeared=tuple(keys_appeared),
        keys_vanished=tuple(keys_vanished),
        steps=tuple(steps),
        options=tuple(_options(a, b)),
    )


def optimizer_differences(
    a: CheckpointInventory, b: CheckpointInventory, values_a: Values, values_b: Values
) -> tuple[tuple[OptimizerDifference, ...], tuple[str, ...], tuple[str, ...]]:
    """Each pair of matched optimizers compared, and the places of those found on one side only."""
    pairs, only_a, only_b = _matched(a.optimizers, b.optimizers)

    def where(opt: OptimizerInventory) -> str:
        return f"{opt.file}:{opt.location}" if opt.file else opt.location

    def named(x: OptimizerInventory, y: OptimizerInventory) -> tuple[dict[ParamKey, str], dict[ParamKey, str]]:
        if x.key_style == y.key_style:
            return {}, {}
        return index_names(x, a), index_names(y, b)

    return (
        tuple(optimizer_difference(x, y, values_a, values_b, named(x, y)) for x, y in pairs),
        tuple(where(opt) for opt in only_a),
        tuple(where(opt) for opt in only_b),
    )


def described(leaf: Leaf | None) -> str | None:
    """A leaf for humans: ``float32 [4, 8]``, a value, ``1024 bytes``."""
    if leaf is None:
        return None
    if isinstance(leaf, TensorLeaf):
        return f"{leaf.dtype} {list(leaf.shape)}"
    if isinstance(leaf, ValueLeaf):
        return leaf.shown
    return f"{leaf.length} bytes"


def leaf_differences(name: LeafName, a: Leaf, b: Leaf) -> list[LeafDifference]:
    """How two leaves of one name differ in what they are; [] where only their bytes can say."""
    text = leaf_text(name)
    if type(a) is not type(b):
        return [LeafDifference(text, "kind", described(a), described(b))]
    if isinstance(a, ValueLeaf) and isinstance(b, ValueLeaf):
        return [] if a.value == b.value else [LeafDifference(text, "value", a.shown, b.shown)]
    if isinstance(a, RawLeaf) and isinstance(b, RawLeaf):
        return [] if a.length == b.length else [LeafDifference(text, "bytes", described(a), described(b))]
    assert isinstance(a, TensorLeaf) and isinstance(b, TensorLeaf)
    if a.dtype != b.dtype:
        return [LeafDifference(text, "dtype", a.dtype, b.dtype)]
    if a.shape != b.shape:
        return [LeafDifference(text, "shape", str(list(a.shape)), str(list(b.shape)))]
    found = []
    if a.stride is not None and b.stride is not None and a.stride != b.stride and a.numel > 1:
        found.append(LeafDifference(text, "stride", str(list(a.stride)), str(list(b.stride))))
    if a.shares is not None and b.shares is not None and a.shares != b.shares:
        found.append(LeafDifference(text, "sharing", _sharing(a), _sharing(b)))
    return found


def _sharing(leaf: TensorLeaf) -> str:
    assert leaf.shares is not None
    first, count = leaf.shares
    return "its own storage" if count == 1 else f"a storage of {count} tensors, first {'.'.join(first)}"


def _held(leaves: dict[LeafName, Leaf]) -> dict[str, int]:
    """Each file's leaves' bytes, by file."""
    held: dict[str, int] = {}
    for (file, _), leaf in leaves.items():
        if isinstance(leaf, TensorLeaf):
            size = leaf.numel * itemsize(leaf.dtype)
        else:
            size = leaf.length if isinstance(leaf, RawLeaf) else 0
        held[file] = held.get(file, 0) + size
    return held


def files_compared(
    leaves_a: dict[LeafName, Leaf], leaves_b: dict[LeafName, Leaf], differing: set[str]
) -> tuple[FileChange, ...]:
    """Each file of either side: the same, differing, or on one side only, with the bytes of what it holds."""
    held_a, held_b = _held(leaves_a), _held(leaves_b)
    found = []
    for file in sorted(held_a.keys() | held_b.keys()):
        if file not in held_b:
            found.append(FileChange(file, "only in A", held_a[file]))
        elif file not in held_a:
            found.append(FileChange(file, "only in B", held_b[file]))
        else:
            found.append(FileChange(file, "differs" if file in differing else "same", held_b[file]))
    return tuple(found)


def _added_leaves(addition: Addition) -> list[LeafDifference]:
    file, address = addition.file, tuple(path_part(part) for part in addition.address)
    entry = (file, (*address, "state", path_part(addition.param)))
    if not addition.state:
        return [LeafDifference(leaf_text(entry), "only in B", None, "{}")]
    return [
        LeafDifference(
            leaf_text((file, (*entry[1], key))),
            "only in B",
            None,
            f"{value.dtype} {list(value.shape)}" if isinstance(value, FreshTensor) else shown(value),
        )
        for key, value in addition.state
    ]


def repair_difference(
    inventory: CheckpointInventory, plan: RepairPlan, out: str, files: tuple[FileChange, ...], tally: LeafTally
) -> Difference:
    """A repair's copy as ``diff`` would find it against its original, from the plan alone: per optimizer the
    entries added (an index named by its model where it has one), the renames and drops, the options added; each
    added leaf; ``files`` as the copy was written, and ``tally``: what the proof compared."""
    optimizers = []
    for opt in inventory.optimizers:

        def here(item: Addition | ParamChange | GroupOption, opt: OptimizerInventory = opt) -> bool:
            return (item.file, item.location) == (opt.file, opt.location)

        added = [addition for addition in plan.additions if here(addition)]
        changes = [change for change in plan.changes if here(change)]
        options = [option for option in plan.options if here(option)]
        if not (added or changes or options):
            continue
        names = index_names(opt, inventory)

        def named(param: ParamKey, names: dict[ParamKey, str] = names) -> str:
            return f"{param} ({names[param]})" if param in names else str(param)

        optimizers.append(
            OptimizerDifference(
                location=opt.location,
                file_a=opt.file,
                file_b=opt.file,
                only_in_a=tuple(named(change.old) for change in changes),
                only_in_b=tuple(str(change.new) for change in changes if change.new is not None),
                appeared=tuple(named(addition.param) for addition in added if not addition.replaces),
                vanished=(),
                keys_appeared=tuple(
                    (named(addition.param), key) for addition in added if addition.replaces for key, _ in addition.state
                ),
                keys_vanished=(),
                steps=(),
                options=tuple(OptionChange(option.group, option.key, None, shown(option.value)) for option in options),
            )
        )
    leaves = tuple(leaf for addition in plan.additions for leaf in _added_leaves(addition))
    return Difference(inventory.path, out, False, tuple(optimizers), (), (), leaves, tally, 0.0, files)
