"""The conv shapes real nets have, on the conv rule: depthwise 3x3 / 5x5 at stride 1 and 2,
a 3-channel stem (padding read in place, its kw x c reduction unrolled), and a 1x1 conv over
many channels at 7x7 (a 7-pixel x 3-vector tile, not one pixel x every channel). Each matches
float64 within its bound, is vectorized over channels and parallel, and a bug planted in each
new path is caught by verification. Grouped convs (RegNet's 8-wide groups) take vectors
within a group, so each input value is one broadcast, not a gather across groups."""

from __future__ import annotations

import pytest
from tvm import s_tir, te, tirx
from tvm.ir.expr import TensorLoad
from tvm_ffi.structural import structural_mutate, structural_walk

import opsdk
from opsdk.kernels import tvm_conv2d
from opsdk.schedules import _conv
from opsdk.schedules._conv import schedule_conv2d
from opsdk.schedules._core import accumulator_registers
from opsdk.verify import Case, run_case

# (id, input shape NHWC, attrs): static dims, bias present.
SHAPES = [
    ("dw3_s1", (1, 12, 10, 32), {"layout": "NHWC_dw", "channels": 32, "kernel": 3,
                                 "stride": 1, "padding": 1, "activation": "silu"}),
    ("dw3_s2", (1, 13, 11, 48), {"layout": "NHWC_dw", "channels": 48, "kernel": 3,
                                 "stride": 2, "padding": 1, "activation": "relu"}),
    ("dw5_s1", (1, 9, 9, 16), {"layout": "NHWC_dw", "channels": 16, "kernel": 5,
                               "stride": 1, "padding": 2, "activation": "hardswish"}),
    ("dw5_s2", (1, 14, 14, 32), {"layout": "NHWC_dw", "channels": 32, "kernel": 5,
                                 "stride": 2, "padding": 2, "activation": "silu"}),
    ("stem3", (1, 20, 18, 3), {"layout": "NHWC", "channels": 16, "kernel": 3, "stride": 2,
                               "padding": 1, "activation": "hardswish"}),
    ("pw_7x7", (1, 7, 7, 96), {"layout": "NHWC", "channels": 192, "kernel": 1, "stride": 1,
                               "padding": 0, "activation": "silu"}),
    ("pw_14x14", (1, 14, 14, 32), {"layout": "NHWC", "channels": 128, "kernel": 1, "stride": 1,
                                   "padding": 0, "activation": "relu"}),
]


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    from opsdk.registry import register_kernels

    register_kernels()


def _case(shape, attrs, target="x86", seed=3):
    return Case("tvm_conv2d", target, "float32", attrs["layout"], shape, attrs, ("bias",), {},
                seed, static=True)


#: Tile choices are per register file: inspected (never run) for an AVX-512 CPU and an
#: AVX2-only one, whatever the host is.
AVX512 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"}
AVX2 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3"}


def _scheduled(shape, attrs, target=AVX512) -> tirx.PrimFunc:
    """The conv rule's schedule of the kernel (AVX-512 unless told: 16 lanes, 32 registers)."""
    k, o = attrs["kernel"], attrs["channels"]
    c = shape[3]
    dw = attrs["layout"].endswith("dw")
    x = te.placeholder(shape, name="x")
    w = te.placeholder((k, k, 1 if dw else c // attrs.get("groups", 1), c if dw else o),
                       name="w")
    b = te.placeholder((c if dw else o,), name="bias")
    y = tvm_conv2d.compute(x, w, b, None, **attrs)
    tgt = opsdk.target(target)
    sch = schedule_conv2d(te.create_prim_func([x, w, b, y]), tgt,
                          acc_regs=accumulator_registers(tgt))
    assert sch is not None
    return sch.mod["main"]


def _loops(func) -> list:
    loops: list = []
    structural_walk(func, [(tirx.For, lambda n: loops.append(n))])
    return loops


def _extent(lp) -> int:
    return int(lp.extent.value) if isinstance(lp.extent, tirx.IntImm) else -1


def _named(func, name: str) -> list:
    return [lp for lp in _loops(func) if str(lp.loop_var.name) == name]


@pytest.mark.parametrize(("shape", "attrs"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_matches_float64_on_the_conv_rule(shape, attrs):
    res = run_case(_case(shape, attrs))
    assert res.ok, (res.status, res.message)
    assert res.rule == "x86.conv2d"  # not the catch-all


@pytest.mark.parametrize(("shape", "attrs"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_vectorized_over_channels_and_parallel(shape, attrs):
    f = _scheduled(shape, attrs)
    loops = _loops(f)
    vec = [_extent(lp) for lp in loops if lp.kind == tirx.ForKind.VECTORIZED]
    par = [_extent(lp) for lp in loops if lp.kind == tirx.ForKind.PARALLEL]
    out_c = attrs["channels"] if not attrs["layout"].endswith("dw") else shape[3]
    assert 16 in vec or out_c in vec  # full AVX-512 vectors (or one vector of all channels)
    assert par and max(par) >= 2  # work for 2+ threads


def test_stem_reads_its_padding_in_place_and_unrolls_the_window_row():
    _, shape, attrs = SHAPES[4]
    f = _scheduled(shape, attrs)
    # No separate padding pass: no buffer of the padded input's shape (1, 22, 20, 3).
    allocated: list = []
    structural_walk(f, [(s_tir.SBlock, lambda b: allocated.extend(b.alloc_buffers))])
    padded = (1, shape[1] + 2, shape[2] + 2, 3)
    assert allocated  # the accumulator tile at least
    assert all(tuple(int(d) for d in b.shape) != padded for b in allocated)
    (rc,) = _named(f, "rc")
    (rx,) = _named(f, "rx")
    assert (rc.kind, _extent(rc)) == (tirx.ForKind.UNROLLED, 3)
    assert (rx.kind, _extent(rx)) == (tirx.ForKind.UNROLLED, 3)


def _allocated_shapes(f) -> list[tuple[int, ...]]:
    allocated: list = []
    structural_walk(f, [(s_tir.SBlock, lambda b: allocated.extend(b.alloc_buffers))])
    return [tuple(int(d) for d in b.shape) for b in allocated]


@pytest.mark.parametrize("which", [5, 6], ids=["pw_7x7", "pw_14x14"])
def test_unpadded_convs_read_their_input_in_place(which):
    # TVM's conv has a pad_temp stage even at padding 0: a copy of the whole input in a
    # pass of its own (MobileNetV2 10 % and ResNet-50 4.7 % slower with it, side by side)
    _, shape, attrs = SHAPES[which]
    assert shape not in _allocated_shapes(_scheduled(shape, attrs))
    # a padded dense conv over many channels keeps its padding pass (cheaper than a bounds
    # test on every load, see schedule_conv2d)
    padded = {**attrs, "kernel": 3, "padding": 1}
    assert (1, shape[1] + 2, shape[2] + 2, shape[3]) in _allocated_shapes(
        _scheduled(shape, padded))


def test_depthwise_5x5_unrolls_its_window_row():
    _, shape, attrs = SHAPES[3]
    (rx,) = _named(_scheduled(shape, attrs), "rx")
    assert (rx.kind, _extent(rx)) == (tirx.ForKind.UNROLLED, 5)


def test_wide_1x1_at_7x7_tiles_the_whole_row():
    # 192 output channels: 7 pixels x 3 vectors (21 accumulators), not 1 pixel x 12 vectors.
    _, shape, attrs = SHAPES[5]
    f = _scheduled(shape, attrs)
    unrolled = {_extent(lp) for lp in _named(f, "xx_1")}
    assert unrolled == {7}
    par = [_extent(lp) for lp in _loops(f) if lp.kind == tirx.ForKind.PARALLEL]
    assert 7 * 192 // 48 in par  # the tiles: rows x channel tiles, across the cores


def test_1x1_at_14x14_tiles_pixels_first_without_a_tail():
    # 8 channel vectors on a 14-pixel row: 7 pixels x 2 vectors (whole row halves; the
    # weight panel streams once per 7 pixels), not 2 pixels x 8 vectors nor 6 + 6 + 2 x 4.
    _, shape, attrs = SHAPES[6]
    f = _scheduled(shape, attrs)
    assert {_extent(lp) for lp in _named(f, "xx_1")} == {7}
    assert {_extent(lp) for lp in _named(f, "ff_1_0")} == {2}


@pytest.mark.parametrize(("pixels", "cin", "cout", "tile"), [
    (28, 128, 512, (4, 2)), (56, 64, 64, (4, 2)), (14, 1024, 256, (2, 4)), (7, 512, 2048, (7, 1)),
])
def test_avx2_1x1_tiles_fit_16_registers(pixels, cin, cout, tile):
    # 8 lanes, 16 registers: pixels x channel vectors with the fewest loads per FMA among
    # the tail-free tiles whose accumulators and weight vectors fit; AVX-512's 7 x 2 spills.
    attrs = {**SHAPES[6][2], "channels": cout}
    f = _scheduled((1, pixels, pixels, cin), attrs, AVX2)
    assert {_extent(lp) for lp in _named(f, "xx_1")} == {tile[0]}
    vecs = {_extent(lp) for lp in _named(f, "ff_1_0")} or {1}
    assert vecs == {tile[1]}
    lanes = {_extent(lp) for lp in _loops(f) if lp.kind == tirx.ForKind.VECTORIZED}
    assert 8 in lanes and not [n for n in lanes if n > 8], lanes


def test_stem_keeps_the_wider_tile():
    # Few input channels (padding read in place, a bounds test per pixel load): the most
    # accumulators, ties to the wider tile: 4 pixels x 4 vectors, not 8 x 2.
    f = _scheduled((1, 20, 16, 3), {**SHAPES[4][2], "channels": 64})
    assert {_extent(lp) for lp in _named(f, "ff_1_0")} == {4}


def _shorten(func, pick):
    """One loop fewer trip: the first loop ``pick`` selects."""
    done: list = []

    def cut(node, mut):
        if done or not pick(node):
            return mut.default_mutate(node)
        done.append(node)
        return tirx.For(node.loop_var, node.min, node.extent - 1, node.kind,
                        mut.mutate(node.body), node.thread_binding, node.annotations)

    out = structural_mutate(func, [(tirx.For, cut)])
    assert done, "the planted bug found no loop to shorten"
    return out


# Each new path with a planted bug (a new shape each, so no earlier build is reused): the
# stem's unrolled channel loop forgets its last channel; the 5x5 depthwise window row its
# last tap; the 7-pixel tile its last pixel; the 7 x 2 tile its last channel vector.
PLANTED = [
    ("stem_short_rc", (1, 22, 16, 3), {**SHAPES[4][2], "channels": 32},
     lambda n: str(n.loop_var.name) == "rc" and n.kind == tirx.ForKind.UNROLLED),
    ("dw5_short_rx", (1, 15, 13, 48), SHAPES[3][2],
     lambda n: str(n.loop_var.name) == "rx" and n.kind == tirx.ForKind.UNROLLED),
    ("pw7_tile_edge", (1, 7, 7, 80), {**SHAPES[5][2], "channels": 240},
     lambda n: str(n.loop_var.name) == "xx_1" and _extent(n) == 7),
    ("pw14_short_vecs", (1, 14, 14, 48), {**SHAPES[6][2], "channels": 128},
     lambda n: str(n.loop_var.name) == "ff_1_0" and n.kind == tirx.ForKind.UNROLLED),
]


@pytest.mark.parametrize(("shape", "attrs", "pick"), [p[1:] for p in PLANTED],
                         ids=[p[0] for p in PLANTED])
def test_a_bug_planted_in_the_path_is_caught(monkeypatch, shape, attrs, pick):
    real = _conv._tile

    def buggy(sch, *a, **kw):
        out = real(sch, *a, **kw)
        return s_tir.Schedule(_shorten(out.mod["main"], pick))

    monkeypatch.setattr(_conv, "_tile", buggy)
    res = run_case(_case(shape, attrs, seed=11))
    assert res.rule == "x86.conv2d"
    assert not res.ok and res.status == "mismatch", (res.status, res.message)


# (id, input shape NHWC, output channels, groups, vector lanes on AVX-512): G = output
# channels per group, Cg = input channels per group.
GROUPED = [
    ("g8_regnet", (1, 7, 7, 64), 64, 8, 8),  # G = Cg = 8: 8-lane vectors
    ("g32_s2", (1, 14, 14, 32), 64, 2, 16),  # G = 32, Cg = 16, stride 2: full vectors
    ("g4", (1, 9, 9, 16), 16, 4, 4),  # G = Cg = 4: 4-lane vectors
]


def _grouped_attrs(o, groups, stride=1):
    return {"layout": "NHWC", "channels": o, "kernel": 3, "stride": stride, "padding": 1,
            "groups": groups, "activation": "relu"}


@pytest.mark.parametrize(("shape", "o", "groups", "lanes"), [g[1:] for g in GROUPED],
                         ids=[g[0] for g in GROUPED])
def test_grouped_conv_matches_float64_with_vectors_inside_a_group(shape, o, groups, lanes):
    attrs = _grouped_attrs(o, groups, 2 if shape[1] == 14 else 1)
    res = run_case(_case(shape, attrs))
    assert res.ok and res.rule == "x86.conv2d", (res.status, res.message, res.rule)
    f = _scheduled(shape, attrs)
    vec = {_extent(lp) for lp in _loops(f) if lp.kind == tirx.ForKind.VECTORIZED
           and "ff" in str(lp.loop_var.name)}
    assert vec == {lanes}, vec
    # Lowered, every load of the input (or its padded copy) has a scalar index: a broadcast
    # per group, where the depthwise path gathered lanes from two groups.
    from opsdk.verify._lints import _lower

    loads: list = []
    structural_walk(_lower(f, opsdk.target(AVX512)), [(TensorLoad, loads.append)])
    # (a padding pass reads x in contiguous vectors, Ramps; a gather is neither)
    idx = [ld.indices[-1] for ld in loads if ld.source.name in ("x", "pad_temp")]
    assert any(i.ty.dtype.lanes == 1 for i in idx), idx
    assert all(isinstance(i, tirx.Ramp) or i.ty.dtype.lanes == 1 for i in idx), idx


def test_a_bug_planted_in_the_grouped_path_is_caught(monkeypatch):
    # the group's unrolled input-channel loop forgets its last channel
    real = _conv._tile

    def buggy(sch, *a, **kw):
        out = real(sch, *a, **kw)
        return s_tir.Schedule(_shorten(out.mod["main"], lambda n: str(n.loop_var.name) == "rc"
                                       and n.kind == tirx.ForKind.UNROLLED))

    monkeypatch.setattr(_conv, "_tile", buggy)
    res = run_case(_case((1, 7, 9, 48), _grouped_attrs(48, 6), seed=11))
    assert res.rule == "x86.conv2d"
    assert not res.ok and res.status == "mismatch", (res.status, res.message)


# Output channels no 8-lane vector divides (RexNet's 38, 27): padded to whole vectors, the
# epilogue over the real channels in a pass of its own.
ODD = [
    ("odd38_1x1", (1, 7, 9, 20), {"layout": "NHWC", "channels": 38, "kernel": 1, "stride": 1,
                                  "padding": 0, "activation": "relu"}),
    ("odd27_3x3_s2", (1, 13, 11, 16), {"layout": "NHWC", "channels": 27, "kernel": 3,
                                       "stride": 2, "padding": 1, "activation": "silu"}),
]


@pytest.mark.parametrize(("shape", "attrs"), [o[1:] for o in ODD], ids=[o[0] for o in ODD])
def test_odd_channel_counts_are_padded_to_whole_vectors(shape, attrs):
    res = run_case(_case(shape, attrs))
    assert res.ok and res.rule == "x86.conv2d", (res.status, res.message, res.rule)
    f = _scheduled(shape, attrs)
    o = attrs["channels"]
    padded = -(-o // 8) * 8
    # the accumulators run over whole 8- or 16-lane vectors: no odd-sized vector of o lanes
    vec = {_extent(lp) for lp in _loops(f) if lp.kind == tirx.ForKind.VECTORIZED
           and "ff" in str(lp.loop_var.name)}
    assert vec and vec <= {8, 16}, vec
    assert any(sh[-1] == padded for sh in _allocated_shapes(f))  # the padded output


def test_a_bug_planted_in_the_channel_padding_is_caught(monkeypatch):
    # the padded weights drop the last real channel (read as a padding zero)
    real = _conv._pad_channels

    def buggy(func, lanes_max):
        out = real(func, lanes_max)
        if out is None:
            return None
        done: list = []

        def lower_bound(node, mut):
            if isinstance(node.b, tirx.IntImm) and int(node.b.value) == 38 and not done:
                done.append(node)
                return tirx.LT(node.a, tirx.IntImm(node.b.ty.dtype, 37))
            return mut.default_mutate(node)

        f = structural_mutate(out[0], [(tirx.LT, lower_bound)])
        assert done
        return f, out[1]

    monkeypatch.setattr(_conv, "_pad_channels", buggy)
    res = run_case(_case((1, 6, 7, 12), {**ODD[0][2], "channels": 38}, seed=11))
    assert res.rule == "x86.conv2d"
    assert not res.ok and res.status == "mismatch", (res.status, res.message)


# Depthwise convs over channel counts no vector divides (RexNet's 162, 702): whole 16-lane
# vectors, the last tile moved back to end at the last channel (it recomputes a few
# channels), no lane predicate left.
DW_ODD = [
    ("dw162", (1, 9, 10, 162), {"layout": "NHWC_dw", "channels": 162, "kernel": 3,
                                "stride": 1, "padding": 1, "activation": "relu6"}),
    ("dw97_s2", (1, 13, 11, 97), {"layout": "NHWC_dw", "channels": 97, "kernel": 3,
                                  "stride": 2, "padding": 1, "activation": "silu"}),
]


def _predicates(f) -> list:
    preds: list = []
    structural_walk(f, [(s_tir.SBlockRealize, lambda r: preds.append(r.predicate))])
    return [p for p in preds if not (isinstance(p, tirx.IntImm) and int(p.value) == 1)]


@pytest.mark.parametrize(("shape", "attrs"), [d[1:] for d in DW_ODD], ids=[d[0] for d in DW_ODD])
def test_depthwise_odd_channels_overlap_the_last_tile(shape, attrs):
    res = run_case(_case(shape, attrs))
    assert res.ok and res.rule == "x86.conv2d", (res.status, res.message, res.rule)
    f = _scheduled(shape, attrs)
    vec = {_extent(lp) for lp in _loops(f) if lp.kind == tirx.ForKind.VECTORIZED
           and "ff" in str(lp.loop_var.name)}
    assert vec == {16}, vec  # whole AVX-512 vectors, not one odd vector of every channel
    mins: list = []
    structural_walk(f, [(tirx.Min, mins.append)])
    assert any(isinstance(m.b, tirx.IntImm) and int(m.b.value) == shape[3] - 16 for m in mins)
    assert not [p for p in _predicates(f) if "ff" in str(p)]  # no lane predicate


def test_a_bug_planted_in_the_overlapped_tile_is_caught(monkeypatch):
    # the last tile moved back one tile too far: the last channels are never computed
    real = _conv._overlap_last_tile
    monkeypatch.setattr(_conv, "_overlap_last_tile",
                        lambda sch, oo, nr, o_ext: real(sch, oo, nr, o_ext - nr))
    res = run_case(_case((1, 7, 8, 41), {**DW_ODD[0][2], "channels": 41}, seed=11))
    assert res.rule == "x86.conv2d"
    assert not res.ok and res.status == "mismatch", (res.status, res.message)


# Rows of a prime pixel count (Inception-v3's 17 x 17 and 73 x 73 maps): the only exact
# pixel tiles are 1 pixel (2 loads per FMA) or the whole row; whole tiles with the last one
# moved back to end at the row's end (6 + 6 + 6 for 17) recompute one pixel and keep every
# register busy. 1x1 768 -> 192 at 17x17, 2 threads: 1.11 -> 0.54 ms.
PRIME_ROWS = [
    ("pw17", (1, 17, 17, 64), {"layout": "NHWC", "channels": 192, "kernel": 1, "stride": 1,
                               "padding": 0, "activation": "relu"}),
    ("c3s2_17", (1, 35, 35, 24), {"layout": "NHWC", "channels": 64, "kernel": 3,
                                  "stride": 2, "padding": 0, "activation": "relu"}),
]


@pytest.mark.parametrize(("shape", "attrs"), [d[1:] for d in PRIME_ROWS],
                         ids=[d[0] for d in PRIME_ROWS])
def test_prime_rows_overlap_the_last_pixel_tile(shape, attrs):
    res = run_case(_case(shape, attrs))
    assert res.ok and res.rule == "x86.conv2d", (res.status, res.message, res.rule)
    f = _scheduled(shape, attrs)
    (mr,) = {_extent(lp) for lp in _named(f, "xx_1")}
    assert 1 < mr < 17 and 17 % mr, mr  # several pixels, not a divisor of the row
    mins: list = []
    structural_walk(f, [(tirx.Min, mins.append)])
    assert any(isinstance(m.b, tirx.IntImm) and int(m.b.value) == 17 - mr for m in mins)
    assert not _predicates(f)  # every tile whole


def test_a_bug_planted_in_the_overlapped_pixel_tile_is_caught(monkeypatch):
    # the last pixel tile moved back one pixel too far: the row's last pixel never computed
    real = _conv._overlap_last_tile
    monkeypatch.setattr(_conv, "_overlap_last_tile",
                        lambda sch, oo, nr, o_ext: real(sch, oo, nr, o_ext - 1))
    # (a shape no other test compiles: verify keeps compiled cases for the session)
    res = run_case(_case((1, 17, 17, 40), {**PRIME_ROWS[0][2], "channels": 96}, seed=11))
    assert res.rule == "x86.conv2d"
    assert not res.ok and res.status == "mismatch", (res.status, res.message)
