"""Layer selections (``--layers``, ``layers=``) and where a module sits: its layer stack, layer index and expert.

A module name such as ``model.decoder.layers.2.mlp.experts.7.up_proj`` holds its layer stack (the path before its
first numeric component), its layer index, its module type (the rest, expert index removed) and its expert; a layer
selection picks layers of every stack (``3``), of one stack (``decoder:3``) or whole stacks (``decoder``). Pure
functions of names: the checkpoint is never read here.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, SupportsIndex

from plate_inspect.errors import ConfigError
from plate_inspect.formatting import counted

if TYPE_CHECKING:
    from plate_inspect.targets import TargetModule

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_PER_EXPERT = re.compile(r"((?:^|\.)experts)\.(\d+)(?=\.)")  # mlp.experts.7.gate_proj
#: mlp.experts.gate_up_proj.7; Granite MoE's block_sparse_moe.input_linear.7
_STACK_SLICE = re.compile(r"^(.*(?:(?:^|\.)experts\.[^.]+|block_sparse_moe\.(?:input|output)_linear))\.(\d+)$")


def span(indices: Iterable[int]) -> str:
    """'0-27' for a contiguous run, '0,1,3' otherwise, 'none' for nothing."""
    present = sorted(set(indices))
    if not present:
        return "none"
    if present == list(range(present[0], present[-1] + 1)):
        return f"{present[0]}-{present[-1]}" if len(present) > 1 else str(present[0])
    return ",".join(map(str, present))


#: One entry of a layer selection (``--layers``, ``layers=``): an int i selects layer i of every layer stack (an
#: encoder-decoder's encoder and decoder both); ``'<stack>:<i>'`` (``'decoder:3'``) layer i of that stack only;
#: ``'<stack>'`` (``'decoder'``; ``'decoder:*'`` is read as the same) every layer of that stack. A stack is named as
#: a report's rows name it (``encoder``, ``decoder``) or by any dotted run of its path's components.
LayerEntry = int | str

#: One comma part of ``--layers``: 'i', 'i-j', 'stack:i', 'stack:i-j', 'stack' or 'stack:*'.
_LAYER_PART = re.compile(r"(?:([A-Za-z_][\w.]*)\s*(?::\s*(?:(\*)|(\d+)(?:\s*-\s*(\d+))?))?|(\d+)(?:\s*-\s*(\d+))?)")
_WHOLE = -1  # the sort key of a whole-stack entry: before the stack's own indices


def _entry(stack: str, index: int | None) -> LayerEntry:
    """The one spelling of an entry: i, 'stack:i', or 'stack' for a whole stack (an index-less entry has a stack)."""
    return stack if index is None else index if not stack else f"{stack}:{index}"


def _entry_key(entry: tuple[str, int | None]) -> tuple[str, int]:
    return entry[0], _WHOLE if entry[1] is None else entry[1]


def parse_layers(spec: str | None) -> list[LayerEntry] | None:
    """'0-3,7' -> [0, 1, 2, 3, 7]; 'encoder:0,decoder:2-3' -> ['decoder:2', 'decoder:3', 'encoder:0'] (a stack
    qualifier applies to its own comma part); 'encoder,decoder:0' -> ['decoder:0', 'encoder'] (a bare stack name, or
    'stack:*', is every layer of it); None or '' -> None (all layers). Entries sorted, plain ones first; an index of
    a stack also given whole is dropped."""
    if spec is not None and not isinstance(spec, str):
        raise ConfigError(f"layers: parse_layers takes a spec string such as '0-3,7' (or None), got {spec!r:.80}")
    if spec is None or spec.strip() == "":
        return None
    out: set[tuple[str, int | None]] = set()
    for part in spec.split(","):
        part = part.strip()
        m = _LAYER_PART.fullmatch(part)
        if not m:
            raise ConfigError(
                f"--layers: cannot parse '{part}'; use e.g. '0-3,7', 'decoder:0-3' for layers of one stack of an "
                "encoder-decoder model, or 'decoder' for all of that stack's layers"
            )
        stack, whole, lo, hi = m.group(1) or "", m.group(2), m.group(3) or m.group(5), m.group(4) or m.group(6)
        if stack and (whole or lo is None):
            out.add((stack, None))
            continue
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ConfigError(f"--layers: empty range '{part}'")
        out.update((stack, i) for i in range(first, last + 1))
    out = {(stack, i) for stack, i in out if i is None or not stack or (stack, None) not in out}
    return [_entry(stack, i) for stack, i in sorted(out, key=_entry_key)]


def layer_entry(entry: object) -> tuple[str, int | None]:
    """(stack or '', index) of one layer-selection entry: an int, or a string 'i' / 'stack:i'; (stack, None) for a
    whole stack ('stack' or 'stack:*'); ConfigError otherwise."""
    if isinstance(entry, str):
        m = _LAYER_PART.fullmatch(entry.strip())
        if m and m.group(4) is None and m.group(6) is None:
            stack, index = m.group(1) or "", m.group(3) or m.group(5)
            return stack, None if index is None else int(index)
    elif isinstance(entry, SupportsIndex) and not isinstance(entry, bool):
        try:
            index = operator.index(entry)
        except TypeError:
            pass
        else:
            if index >= 0:
                return "", index
    raise ConfigError(
        f"layers: {entry!r} is not a layer index (an int >= 0), a 'stack:index' string such as 'decoder:3' or a stack "
        "name such as 'decoder' (all its layers); expand a spec such as '0-3,decoder:5' with "
        "plate_inspect.targets.parse_layers"
    )


def layer_list(layers: Iterable[object]) -> tuple[object, ...]:
    """The entries of a ``layers=`` argument, refusing one string: iterating ``'21'`` or ``'decoder'`` would give
    its characters (layers 2 and 1, stacks 'd', 'e', ...), so a spec must be expanded with :func:`parse_layers`."""
    if isinstance(layers, (str, bytes)):
        raise ConfigError(
            f"layers={layers!r}: a string, not a list of entries; pass a list such as [2, 1] or ['decoder'], or "
            f"expand a spec with plate_inspect.targets.parse_layers({str(layers)!r})"
        )
    return tuple(layers)


def layer_entries(layers: Iterable[object]) -> tuple[LayerEntry, ...]:
    """A layer selection in its one spelling, order kept: ints for plain indices, 'stack:i' strings, 'stack' for a
    whole stack ('decoder:*' becomes 'decoder'); what ScanSettings and the manifest hold."""
    return tuple(_entry(stack, i) for stack, i in map(layer_entry, layer_list(layers)))


def format_layers(layers: Iterable[object]) -> str:
    """'0,1,decoder:3' (or 'decoder' for a whole stack): a layer selection for a message (sorted, each entry once)."""
    entries = sorted(set(map(layer_entry, layer_list(layers))), key=_entry_key)
    return ",".join(str(_entry(stack, i)) for stack, i in entries)


def _stacks(names: Iterable[str]) -> dict[str, set[int]]:
    """The layer stacks among module names (the path before each one's layer index) and each one's indices,
    encoders first, else in first-seen order."""
    found: dict[str, set[int]] = {}
    for name in names:
        where = stack_of(name)
        if where is not None:
            found.setdefault(where[0], set()).add(where[1])
    return dict(sorted(found.items(), key=lambda item: "encoder" not in item[0]))  # stable


def _describe_stacks(stacks: dict[str, set[int]]) -> str:
    """'encoder (encoder.block, 2 layers: 0-1), decoder (decoder.block, 3 layers: 0-2)'."""
    labels = _stack_labels(list(stacks))
    described = (f"{s}, {counted(len(ix), 'layer')}: {span(ix)}" for s, ix in stacks.items())
    return ", ".join(f"{labels[s]} ({d})" if labels[s] else d for s, d in zip(stacks, described, strict=True))


def _names_stack(qualifier: str, stack: str) -> bool:
    """Whether ``qualifier`` names the layer stack ``stack``: it is a run of the stack path's dotted components."""
    q, parts = qualifier.split("."), stack.split(".")
    return any(parts[k : k + len(q)] == q for k in range(len(parts)))


def _stack_named(qualifier: str, stacks: dict[str, set[int]], entry: str) -> str:
    """The one stack whose path holds ``qualifier`` as a run of its dotted components; ConfigError otherwise."""
    hits = [s for s in stacks if _names_stack(qualifier, s)]
    if len(hits) == 1:
        return hits[0]
    if not stacks:
        raise ConfigError(f"--layers {entry}: this model has no numbered layers, so no stack '{qualifier}'")
    if len(stacks) == 1:
        ((only, indices),) = stacks.items()
        raise ConfigError(
            f"--layers {entry}: this model has one layer stack ({only}, {len(indices)} layers: {span(indices)}), "
            f"not '{qualifier}': a 'stack:index' or 'stack' entry selects one stack of an encoder-decoder model (T5, "
            "BART); give "
            "plain layer indices, e.g. --layers 0-3"
        )
    if not hits:
        raise ConfigError(
            f"--layers {entry}: no layer stack '{qualifier}' in this model; its stacks: {_describe_stacks(stacks)}"
        )
    labels = _stack_labels(list(stacks))
    raise ConfigError(
        f"--layers {entry}: '{qualifier}' names {len(hits)} layer stacks ({', '.join(hits)}); name one: "
        + ", ".join(labels[s] for s in stacks)
    )


def select_layers(
    targets: Sequence[TargetModule], layers: Iterable[object], names: Iterable[str]
) -> list[TargetModule]:
    """The targets a layer selection keeps (possibly none): a plain index i keeps layer i of every stack, a
    'stack:i' entry layer i of that stack, a 'stack' entry all of that stack's layers (:data:`LayerEntry`). The stacks
    and their layers are those among ``names`` (the checkpoint's, or the bundle's, modules). A stack that ``names`` do
    not have, a stack qualifier on a single-stack model, or an index past the named stack's layers is a ConfigError
    naming what is there."""
    entries = [layer_entry(e) for e in layer_list(layers)]
    plain = {i for stack, i in entries if not stack}
    qualified: set[tuple[str, int]] = set()
    whole: set[str] = set()
    stacks = _stacks(names) if any(stack for stack, _ in entries) else {}
    for stack, i in entries:
        if not stack:
            continue
        path = _stack_named(stack, stacks, str(_entry(stack, i)))
        if i is None:
            whole.add(path)
            continue
        if i not in stacks[path]:
            label = _stack_labels(list(stacks))[path] or path
            raise ConfigError(
                f"--layers {stack}:{i}: the {label} stack ({path}) has {counted(len(stacks[path]), 'layer')} "
                f"({span(stacks[path])}), no layer {i}"
            )
        qualified.add((path, i))
    kept = []
    for t in targets:
        where = stack_of(t.name)
        if t.layer in plain or where in qualified or (where is not None and where[0] in whole):
            kept.append(t)
    return kept


def layers_there(names: Iterable[str], model_names: Iterable[str] | None = None) -> str:
    """The layers present among module names, for an error: '0-27', or per stack 'encoder 0-1, decoder 0-2'.

    ``model_names``: the model's modules, when ``names`` are a bundle's or adapter's: names holding one stack of a
    model with several are then labelled with it ('decoder 0-2', not '0-2', which reads as both stacks' layers)."""
    stacks = _stacks(names)
    every = list(_stacks(model_names)) if model_names is not None else []
    if len(stacks) < 2 and len(every) < 2:
        return span(i for indices in stacks.values() for i in indices)
    labels = _stack_labels(every if len(every) >= 2 else list(stacks))
    return ", ".join(f"{labels.get(s, s)} {span(ix)}" for s, ix in stacks.items())


def split_expert(module_type: str) -> tuple[str, int | None]:
    """('mlp.experts.7.gate_proj' | 'mlp.experts.gate_up_proj.7') -> ('mlp.experts.gate_proj' | ..., 7)."""
    if "experts" not in module_type and "block_sparse_moe" not in module_type:
        return module_type, None
    m = _PER_EXPERT.search(module_type)
    if m is not None:
        return module_type[: m.end(1)] + module_type[m.end() :], int(m.group(2))
    m = _STACK_SLICE.match(module_type)
    return (m.group(1), int(m.group(2))) if m else (module_type, None)


def module_type_of(name: str) -> str:
    """The part of a module name after its layer index, expert index removed ('model.layers.3.mlp.up_proj' ->
    'mlp.up_proj'; 'model.layers.3.mlp.experts.7.up_proj' -> 'mlp.experts.up_proj')."""
    m = _LAYER_INDEX.search(name + ".")
    return split_expert(name[m.end() :] if m else name)[0]


def expert_of(name: str) -> int | None:
    """The expert index in a module name, or None for a dense module."""
    m = _LAYER_INDEX.search(name + ".")
    return split_expert(name[m.end() :] if m else name)[1]


def layer_of(name: str) -> int | None:
    """The first numeric path component of a module name (its layer index), or None."""
    m = _LAYER_INDEX.search(name + ".")
    return int(m.group(1)) if m else None


def stack_of(name: str) -> tuple[str, int] | None:
    """(the layer stack, the layer index) of a module name: the path before its first numeric component and that
    number ('model.decoder.layers.2.fc1' -> ('model.decoder.layers', 2)); None outside numbered layers."""
    m = _LAYER_INDEX.search(name + ".")
    return None if m is None else (name[: m.start()], int(m.group(1)))


def layer_rows(names: Iterable[str], layers: Iterable[object] | None = None) -> tuple[list[str], dict[str, str | None]]:
    """Heatmap rows of modules: (the row labels in order, each module's label; None outside numbered layers).

    A row is a layer index; where the names lie in several layer stacks (T5's or BART's encoder and decoder, both
    counting from 0), the stack's distinguishing part comes first ('encoder 0', ..., 'decoder 2'), encoders first,
    else in first-seen order, so two stacks' layer i are two rows, not one cell holding both. ``layers``: the
    selection that chose the names (a bundle's); where it names their one stack ('decoder:1', 'decoder'), that stack
    is one of several in the model, so its rows carry the name the selection gave it ('decoder 1'), not '1'.
    """
    names = list(names)
    where = {name: stack_of(name) for name in names}
    stacks = list(_stacks(names))
    short = _stack_labels(stacks)
    if len(stacks) == 1 and layers is not None:
        named = [stack for stack, _ in map(layer_entry, layers) if stack and _names_stack(stack, stacks[0])]
        if named:  # the shortest name the selection gave it
            short[stacks[0]] = min(named, key=lambda q: (q.count("."), len(q), q))

    def label(w: tuple[str, int]) -> str:
        return f"{short[w[0]]} {w[1]}" if short[w[0]] else str(w[1])

    ordered = sorted({w for w in where.values() if w is not None}, key=lambda w: (stacks.index(w[0]), w[1]))
    return [label(w) for w in ordered], {n: None if w is None else label(w) for n, w in where.items()}


def _stack_labels(stacks: list[str]) -> dict[str, str]:
    """What tells layer stacks apart: '' for a single stack, else each one's path without the components every
    stack shares at its start and end ('model.encoder.layers', 'model.decoder.layers' -> 'encoder', 'decoder')."""
    if len(stacks) < 2:
        return dict.fromkeys(stacks, "")
    parts = [s.split(".") for s in stacks]
    head = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    return {s: ".".join(p[head : len(p) - tail]) or s for s, p in zip(stacks, parts, strict=True)}
