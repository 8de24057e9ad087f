"""Kernel corners: the kernel families' attribute combinations and tile edges, on purpose.

Random draws keep most examples on the default attributes (each signature is a compile), so
a rule bug that needs two non-default attributes together (a 1x1 window with stride 2, a
dilated window with uneven padding) shows up in a few percent of examples and is caught on
some seeds only. This module lists, for each kernel family (:data:`opsdk.kernels.KERNEL_OPS`),
a deterministic set of examples that every run starts with:

- a **pairwise covering array** of the non-default attribute values (stride x padding x
  kernel x dilation x groups ..., the layout among the factors): every pair of values of two
  attributes is in some example, whatever the seed (:func:`pairwise`);
- **tile edges** assigned along those rows: one below, at and one above each rule tile size
  (a matmul's N and a conv's output channels around every multiple of the vector width the
  rules tile by, a conv's output row around its pixel tile, a Winograd output row whose 2x2
  tiles fall around the GEMM's 8-row register tile), channels no vector width divides, 1x1
  and > 32 spatial sizes, odd sizes;
- every epilogue (each activation, with bias, residual, both and neither: chains of two),
  packed constant weights on some rows and runtime weights on the others, a batch of 1 to 3
  behind a symbolic batch dim and some rows with every dim static.

The rows are spread over the family's cells by their layout (a factor of the covering array),
so the cells together hit every pair; each row is one compile (its own signature), which
bounds the cost (:func:`kernel_corners`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._opdef import OpDef
from ._case import Case, is_valid, layout_attrs

__all__ = ["KERNEL_CORNER_FAMILIES", "kernel_corners", "kernel_rows", "pairwise", "tile_edges"]

Row = dict[str, Any]

#: Uncovered pairs each new covering-array row is tried from (:func:`pairwise`).
_SEEDS = 24


def pairwise(factors: Mapping[str, Sequence[Any]],
             ok: Callable[[Row], bool] = lambda r: True,
             balance: str | None = None) -> list[Row]:
    """A covering array of strength 2: rows (one value per factor) such that every pair of
    values of two factors that ``ok`` allows together is in some row. Greedy and
    deterministic (each row starts from the first uncovered pair and takes, factor by
    factor, the value covering the most uncovered pairs; ties to the earlier value).

    ``ok`` sees partial rows (only the factors set so far) and says whether they can be
    completed; a pair it refuses is not required. ``balance`` names a factor whose values
    should take about as many rows each (the layout: the rows of a cell are its compiles):
    rows move to a rarer value where every pair stays covered.

    Examples
    --------
    >>> from opsdk.verify._kcorners import pairwise
    >>> rows = pairwise({"a": [0, 1, 2], "b": [0, 1], "c": [0, 1]})
    >>> len(rows), all({(r["a"], r["b"]) for r in rows} >= {(a, b) for a in range(3)
    ...                 for b in range(2)} for _ in [0])
    (6, True)
    """
    fixed = {n: next(iter(v)) for n, v in factors.items() if len(v) == 1}
    if fixed:  # a factor with one value pairs with everything in every row
        rest = pairwise({n: v for n, v in factors.items() if n not in fixed},
                        lambda r: ok({**fixed, **r}), balance)
        return [{**fixed, **r} for r in rest] if rest else [dict(fixed)]
    names = list(factors)
    vals = {n: list(factors[n]) for n in names}

    def pairs_of(row: Row) -> set[tuple]:
        return {(i, vals[names[i]].index(row[names[i]]), j, vals[names[j]].index(row[names[j]]))
                for i, j in itertools.combinations(range(len(names)), 2)
                if names[i] in row and names[j] in row}

    todo = {(i, a, j, b)
            for i, j in itertools.combinations(range(len(names)), 2)
            for a in range(len(vals[names[i]])) for b in range(len(vals[names[j]]))
            if ok({names[i]: vals[names[i]][a], names[j]: vals[names[j]][b]})}
    def grow(seed: tuple, order: list[str]) -> Row | None:
        i, a, j, b = seed
        row = {names[i]: vals[names[i]][a], names[j]: vals[names[j]][b]}
        for n in order:
            if n in row:
                continue
            best = None
            for v in vals[n]:
                trial = {**row, n: v}
                if not ok(trial):
                    continue
                gain = len(pairs_of(trial) & todo)
                if best is None or gain > best[0]:
                    best = (gain, v)
            if best is None:  # nothing completes it
                return None
            row[n] = best[1]
        return row

    # Each row: the best of several greedy candidates (seeded by the first uncovered pairs,
    # factors filled in two orders), which comes near the fewest rows (9 for four factors
    # of three values, where one seed and order took 14).
    orders = [names[k:] + names[:k] for k in range(min(4, len(names)))]
    orders += [o[::-1] for o in orders]
    rows: list[Row] = []
    while todo:
        best_row, best_gain = None, 0
        for seed in sorted(todo)[:_SEEDS]:
            for order in orders:
                row = grow(seed, order)
                gain = len(pairs_of(row) & todo) if row is not None else 0
                if gain > best_gain:
                    best_row, best_gain = row, gain
        if best_row is None:  # the first pair cannot be completed: not required
            todo.discard(min(todo))
            continue
        rows.append(best_row)
        todo -= pairs_of(best_row)
    if balance is not None:
        _balance(rows, balance, vals[balance], pairs_of, ok)
    return rows


def _balance(rows: list[Row], factor: str, values: list[Any],
             pairs_of: Callable[[Row], set], ok: Callable[[Row], bool]) -> None:
    """Move rows to the least used values of ``factor`` while every covered pair stays
    covered (in place, deterministic)."""
    need: dict[tuple, int] = {}
    for r in rows:
        for p in pairs_of(r):
            need[p] = need.get(p, 0) + 1
    for k, r in enumerate(rows):
        count = {v: sum(x[factor] == v for x in rows) for v in values}
        for v in sorted(values, key=lambda v: (count[v], values.index(v))):
            if count[v] + 1 >= count[r[factor]]:
                break
            new = {**r, factor: v}
            lost = pairs_of(r) - pairs_of(new)
            if not ok(new) or any(need[p] <= 1 for p in lost):
                continue
            for p in lost:
                need[p] -= 1
            for p in pairs_of(new) - pairs_of(r):
                need[p] = need.get(p, 0) + 1
            rows[k] = new
            break


def tile_edges(tiles: Sequence[int]) -> list[int]:
    """One below, at and one above each tile size (positive, in order, no repeats).

    Examples
    --------
    >>> from opsdk.verify._kcorners import tile_edges
    >>> tile_edges([1, 16, 32])
    [1, 2, 15, 16, 17, 31, 32, 33]
    """
    out: list[int] = []
    for t in tiles:
        for v in (t - 1, t, t + 1):
            if v >= 1 and v not in out:
                out.append(v)
    return out


def _dedupe(vals: Sequence[int]) -> list[int]:
    out: list[int] = []
    for v in vals:
        if v >= 1 and v not in out:
            out.append(v)
    return out


#: Activations in the order rows take them (every one in each family).
_ACTS = ("relu", "silu", "none", "relu6", "hardswish", "sigmoid", "tanh")
#: Optional inputs of an epilogue in the order rows take them: both (a chain of two adds
#: before the activation), neither, each alone.
_PRESENT = (("bias", "residual"), (), ("bias",), ("residual",))


def _assign(rows: list[Row], column: str, values: Sequence[Any],
            fits: Callable[[Row], bool], spare: Sequence[Any] = range(1, 65)) -> list[Row]:
    """Give each row a ``column`` value: values not used yet first (in order), the first
    that ``fits`` the row, else the first ``spare`` value that does (a dilated 7x7 window
    needs 13 pixels); rows are added (copies of the first row a value fits) until every
    value is used once, so each value is hit at least once."""
    unused = list(values)
    out: list[Row] = []
    for k, row in enumerate(rows):
        cands = [*unused, *(values[(k + s) % len(values)] for s in range(len(values))),
                 *spare]
        pick = next((v for v in cands if fits({**row, column: v})), None)
        if pick is None:
            continue  # no value fits: the row goes (its pairs are elsewhere or impossible)
        if pick in unused:
            unused.remove(pick)
        out.append({**row, column: pick})
    for v in unused:
        base = next((r for r in out if fits({**r, column: v})), None)
        if base is not None:
            out.append({**base, column: v})
    return out


# ------------------------------------------------------------------ the families


def _conv_case(d: OpDef, row: Row, target: str) -> Case:
    a = {**layout_attrs(d, row["layout"]),
         **{k: v for k, v in row.items() if k in {p.name for p in d.attr_params}}}
    nchw = row["layout"].startswith("NCHW")
    n, c, h, w = row.get("batch", 2), row.get("cin", 16), row.get("h", 16), row.get("w", 16)
    shape = (n, c, h, w) if nchw else (n, h, w, c)
    return _case(d, target, row, a, shape)


def _case(d: OpDef, target: str, row: Row, attrs: Row, shape: Sequence[int]) -> Case:
    present = tuple(p for p in row.get("present", ()) if p in {q.name for q in d.tensor_params})
    optional = {p.name for p in d.tensor_params if p.optional}
    data = {d.primary: row.get("recipe", "domain")}
    data.update({p.name: "domain" for p in d.tensor_params[1:]
                 if p.name in present or p.name not in optional})
    return Case(d.name, target, "float32", row["layout"], tuple(int(s) for s in shape),
                dict(attrs), present, data, 100 + row.get("index", 0),
                static=bool(row.get("static", False)),
                packed=bool(row.get("packed", False)) and bool(d.weights))


def _conv_rows(d: OpDef, target: str, lanes: int) -> list[Case]:
    ln = lanes
    # Output channels: each channel-vector tile width (1 to 5 vectors, and the widest, 12),
    # one below / at / above; half and quarter vectors (24 / 20 on AVX-512); one channel.
    outs = _dedupe([*tile_edges([ln, 2 * ln, 3 * ln, 4 * ln]), 5 * ln + 1, 6 * ln,
                    *tile_edges([12 * ln]), 97, 3 * ln // 2, 5 * ln // 4, 7, 1])
    # Input channels no vector width divides, a 3-channel stem (padding read in place below
    # 8 channels), and round ones.
    cins = _dedupe([ln + 1, 3, ln - 1, 2 * ln + 3, 8, ln, 7, 4 * ln])
    # Output rows around the pixel tile (8) and the pixel-vector tiles of a depthwise NCHW
    # conv (the lanes), 1x1, above 32, odd.
    widths = _dedupe([9, 8, 7, 1, 33, 35, ln + 1, ln - 1, 2 * ln + 1, 17, 5])
    heights = (7, 1, 9, 4, 33, 5)
    edge_pads = {"padding": [0, 1, 2, 3], "pad_left": [-1, 0, 2], "pad_bottom": [-1, 0, 2],
                 "pad_right": [-1, 0, 1]}
    # kernel_h 1: a one-row window (a conv1d, as ChannelsLast runs it)
    dense = pairwise({"layout": ["NCHW", "NHWC"], "kernel": [1, 3, 5, 7], "kernel_h": [-1, 1],
                      "stride": [1, 2, 3], **edge_pads, "dilation": [1, 2], "groups": [1, 2, 4]},
                     balance="layout")
    dw = pairwise({"layout": ["NCHW_dw", "NHWC_dw"], "kernel": [3, 1, 5, 7],
                   "kernel_h": [-1, 1], "stride": [1, 2, 3], **edge_pads, "dilation": [1, 2],
                   "multiplier": [1, 2, 3]}, balance="layout")
    rows = _common_columns(dense + dw)

    def fits(r: Row) -> bool:
        return is_valid(d, _conv_case(d, r, target).shape, "float32",
                        _conv_case(d, r, target).attrs, r.get("present", ()))

    dense_rows = [r for r in rows if "groups" in r]
    dw_rows = [r for r in rows if "multiplier" in r]
    # spatial sizes first (the window must fit), with channels every group count divides
    for col, vals in (("w", widths), ("h", heights), ("channels", outs), ("cin", cins)):
        dense_rows = _assign(dense_rows, col, vals, fits)
    # depthwise: the channel count is the input's (times the multiplier)
    for col, vals in (("w", _dedupe([*tile_edges([ln, 2 * ln, 4 * ln]), 8, 9, 1, 35])),
                      ("h", heights),
                      ("cin", _dedupe([*tile_edges([ln, 2 * ln]), 4 * ln + 1, 3, 12 * ln + 1]))):
        dw_rows = _assign(dw_rows, col, vals, fits)
    return [_conv_case(d, r, target) for r in _number(dense_rows + dw_rows)]


def _common_columns(rows: list[Row]) -> list[Row]:
    """The columns every family's rows cycle through: the activation, the optional inputs,
    the batch (1 to 3, symbolic), every fourth row static, every third packed (constant
    weights), the data recipe."""
    out = []
    for k, r in enumerate(rows):
        out.append({**r, "activation": _ACTS[k % len(_ACTS)],
                    "present": _PRESENT[k % len(_PRESENT)], "batch": (2, 1, 3)[k % 3],
                    "static": k % 4 == 3, "packed": k % 3 == 1 and k % 4 != 3,
                    "recipe": ("domain", "normal")[k % 2]})
    return out


def _number(rows: list[Row]) -> list[Row]:
    return [{**r, "index": k} for k, r in enumerate(rows)]


def _winograd_rows(d: OpDef, target: str, lanes: int) -> list[Case]:
    ln = lanes
    rows = _common_columns(pairwise({"layout": ["NHWC"], "padding": [0, 1, 2],
                                     "pad_left": [-1, 0, 2], "pad_bottom": [-1, 0, 2],
                                     "pad_right": [-1, 0, 1]}))

    def case(r: Row) -> Case:
        a = {**layout_attrs(d, "NHWC"), **{k: v for k, v in r.items()
                                            if k in {p.name for p in d.attr_params}}}
        left, right = (a["padding"] if a[k] < 0 else a[k] for k in ("pad_left", "pad_right"))
        # the output width is the column (its 2x2 tiles are what the rule tiles)
        w = max(1, r.get("ow", 6) + 2 - left - right)
        return _case(d, target, r, a, (r.get("batch", 2), r.get("h", 6), w, r.get("cin", 16)))

    def fits(r: Row) -> bool:
        c = case(r)
        return is_valid(d, c.shape, "float32", c.attrs, c.present)

    # Output channels around the GEMM's tile widths; input channels on and off the vector
    # width (the input transform's vector path); output widths whose 2x2 tiles per row
    # (ow / 2) fall one below / at / above the register tile's 8 rows, odd and even outputs
    # (a last tile half outside), 1-pixel outputs, above 32.
    # (Each Winograd compile costs seconds: the lists stay within about a row each.)
    rows = _assign(rows, "channels", _dedupe([*tile_edges([ln, 4 * ln]), 1, 3 * ln // 2]), fits)
    rows = _assign(rows, "cin", _dedupe([ln, ln + 1, 3, ln - 1]), fits)
    rows = _assign(rows, "ow", _dedupe([13, 16, 17, 1, 33, 18, 2]), fits)
    rows = _assign(rows, "h", (5, 4, 1, 9, 3, 6), fits)
    return [case(r) for r in _number(rows)]


def _matmul_rows(d: OpDef, target: str, lanes: int) -> list[Case]:
    ln = lanes
    # N: one below / at / above each tile width the rule builds (1 to 4 vectors), a padded
    # last tile past 4 vectors, a classifier head (1000 and 1001 classes), half vectors.
    ns = _dedupe([*tile_edges([ln, 2 * ln, 3 * ln, 4 * ln]), 5 * ln + 3, 1000, 1001, ln // 2 + 1,
                  3 * ln // 2, 1])
    layouts = list(d.layouts)
    rows = _common_columns([{"layout": layouts[k % len(layouts)]} for k in range(len(ns))])

    def case(r: Row) -> Case:
        a = {**layout_attrs(d, r["layout"]), "n": r.get("n", 16),
             "activation": r["activation"]}
        m, k = r.get("m", 9), r.get("k", 19)
        shape = (r["batch"], m, k) if r["layout"].startswith("batched") else (m, k)
        return _case(d, target, r, a, shape)

    def fits(r: Row) -> bool:
        c = case(r)
        return is_valid(d, c.shape, "float32", c.attrs, c.present)

    rows = _assign(rows, "n", ns, fits)
    # rows around the row tile (8), K on and off the vector width, a long K
    rows = _assign(rows, "m", (7, 8, 9, 17, 1, 3), fits)
    rows = _assign(rows, "k", _dedupe([ln + 1, ln - 1, 3, 2 * ln, 1, 131, ln]), fits)
    return [case(r) for r in _number(rows)]


def _pool_rows(d: OpDef, target: str, lanes: int) -> list[Case]:
    ln = lanes

    def ok(r: Row) -> bool:  # a pool's padding is at most half its window
        return not ("kernel" in r and "padding" in r and 2 * r["padding"] > r["kernel"])

    # max and average apart: count_include_pad pairs with the others among the averages
    common = {"kernel": [3, 2, 7], "stride": [2, 1, 3], "padding": [1, 0, 3],
              "ceil_mode": [True, False]}
    rows = _common_columns(
        pairwise({"layout": ["NCHW_max", "NHWC_max"], **common}, ok, balance="layout")
        + pairwise({"layout": ["NCHW_avg", "NHWC_avg"], **common,
                    "count_include_pad": [True, False]}, ok, balance="layout"))

    def case(r: Row) -> Case:
        a = {**layout_attrs(d, r["layout"]), **{k: v for k, v in r.items()
                                                 if k in ("kernel", "stride", "padding",
                                                          "ceil_mode", "count_include_pad")}}
        c, h, w = r.get("cin", 5), r.get("h", 9), r.get("w", 9)
        shape = ((r["batch"], c, h, w) if a["layout"] == "NCHW" else (r["batch"], h, w, c))
        return _case(d, target, {**r, "present": ()}, a, shape)

    def fits(r: Row) -> bool:
        c = case(r)
        return is_valid(d, c.shape, "float32", c.attrs, ())

    rows = _assign(rows, "cin", _dedupe([ln + 1, ln - 1, 3, 2 * ln + 3, ln]), fits)
    rows = _assign(rows, "w", _dedupe([9, 8, 1, 35, 33, 7, ln + 1]), fits)
    rows = _assign(rows, "h", (8, 9, 1, 7, 33), fits)
    return [case(r) for r in _number(rows)]


def _reduce_rows(d: OpDef, target: str, lanes: int) -> list[Case]:
    ln = lanes
    rows = _common_columns([{"layout": ly} for ly in d.layouts for _ in range(2)])
    if d.name == "tvm_mean":
        def case(r: Row) -> Case:
            c, h, w = r.get("cin", 5), r.get("h", 7), r.get("w", 7)
            shape = (r["batch"], c, h, w) if r["layout"] == "NCHW" else (r["batch"], h, w, c)
            return _case(d, target, {**r, "present": ()}, layout_attrs(d, r["layout"]), shape)
        cols = (("cin", _dedupe([ln + 1, ln - 1, 4 * ln + 1, 1])), ("w", (35, 1, ln + 1, 7)),
                ("h", (33, 1, 3, 8)))
    else:
        def case(r: Row) -> Case:
            a = {**layout_attrs(d, r["layout"]), "reduce": ("max", "sum")[r["index0"] % 2]}
            shape = (r["batch"], r.get("h", 7), r.get("w", 7))
            return _case(d, target, {**r, "present": ()}, a, shape)
        rows = [{**r, "index0": k} for k, r in enumerate(rows)]
        cols = (("w", (ln + 1, 4 * ln - 1, 1, 35)), ("h", (33, 1, ln - 1, 3)))

    def fits(r: Row) -> bool:
        c = case(r)
        return is_valid(d, c.shape, "float32", c.attrs, ())

    for col, vals in cols:
        rows = _assign(rows, col, vals, fits)
    return [case(r) for r in _number(rows)]


#: The generator of each kernel family's rows.
KERNEL_CORNER_FAMILIES: dict[str, Callable[[OpDef, str, int], list[Case]]] = {
    "tvm_matmul": _matmul_rows,
    "tvm_conv2d": _conv_rows,
    "tvm_conv2d_winograd": _winograd_rows,
    "tvm_pool2d": _pool_rows,
    "tvm_mean": _reduce_rows,
    "tvm_reduce": _reduce_rows,
}


_CACHE: dict[tuple, tuple[Case, ...]] = {}


def _rows_cached(d: OpDef, target: str, lanes: int) -> tuple[Case, ...]:
    key = (d.name, id(d), target, lanes)
    if key not in _CACHE:
        gen = KERNEL_CORNER_FAMILIES.get(d.name)
        out: list[Case] = []
        for c in gen(d, target, lanes) if gen is not None else ():
            if c not in out and is_valid(d, c.shape, c.dtype, c.attrs, c.present):
                out.append(c)
        _CACHE[key] = tuple(out)
    return _CACHE[key]


def kernel_rows(d: OpDef, target: str, lanes: int) -> list[Case]:
    """Every kernel corner of family ``d`` over all its cells (empty for other ops).

    Examples
    --------
    >>> from opsdk.kernels import tvm_pool2d
    >>> from opsdk.verify._kcorners import kernel_rows
    >>> rows = kernel_rows(tvm_pool2d, "x86", 16)
    >>> {c.layout for c in rows} == set(tvm_pool2d.layouts)
    True
    """
    if not d.module.startswith("opsdk.kernels"):
        return []
    return list(_rows_cached(d, target, lanes))


def kernel_corners(d: OpDef, target: str, dtype: str, layout: str, lanes: int) -> list[Case]:
    """The kernel corners of one cell: the family's rows (:func:`kernel_rows`) whose layout
    is the cell's. Each is one compile.

    Examples
    --------
    >>> from opsdk.kernels import tvm_conv2d
    >>> from opsdk.verify._kcorners import kernel_corners
    >>> cs = kernel_corners(tvm_conv2d, "x86", "float32", "NHWC", 16)
    >>> len({c.attrs["kernel"] for c in cs}), all(c.layout == "NHWC" for c in cs)
    (4, True)
    """
    if dtype != "float32":
        return []
    return [c for c in kernel_rows(d, target, lanes) if c.layout == layout]
