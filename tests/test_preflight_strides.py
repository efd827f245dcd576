"""smemguard check reads which strides are 1 at launch from how the kernel uses its arguments
(issue #15: a deploy gate that guessed them from their names passed an overflowing kernel)."""

import json
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from smemguard.facts import gpus
from smemguard import preflight

from test_preflight import check_cli, launch_on_fake_l4, results  # noqa: F401 (results is a fixture)

L4 = gpus.lookup("L4")
BIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5)  # 5 stages of 32 KiB tiles
FITTING = dict(BIG, num_stages=4)


@triton.jit
def short_names_matmul(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Issue #15's reproduction: strides named as in many hand-written kernels, not ``stride_*``."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak)
        b = tl.load(b_ptr + (k + rk)[:, None] * sbk + rn[None, :] * sbn)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(tl.float16))


@triton.jit
def weight_nk_matmul(a_ptr, w_ptr, c_ptr, M, N, K, sam, sak, swn, swk, scm, scn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ W^T, W an (N, K) weight: its tile is loaded transposed, so its last-axis offset (rn)
    multiplies swn while swk is the last of its strides: the source does not tell which is 1."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak)
        w = tl.load(w_ptr + (k + rk)[:, None] * swk + rn[None, :] * swn)
        acc += tl.dot(a, w)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(tl.float16))


def args_for(kernel, a, b, c):
    return (a, b, c, a.shape[0], c.shape[1], a.shape[1], *a.stride(), *b.stride(), *c.stride())


def operands(n=256):
    return tuple(torch.empty(n, n, dtype=torch.float16) for _ in range(3))


def discovered(kernel, **hints):
    [found] = preflight.discover([f"{__name__}:{kernel.__name__}"], overrides={"configs": [BIG], **hints})
    return found


def test_issue_15_short_stride_names_are_reported_as_the_launch_overflows(monkeypatch, capsys, results,
                                                                          triton_cache):
    kernel = discovered(short_names_matmul)
    assert kernel.unit_args == ("sak", "sbn", "scn") and kernel.unsure_unit_args == ()
    argv = [f"{__name__}:short_names_matmul", "--meta", "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_stages=5",
            "--gpu", "L4", "--exact", "--json", "--quiet", "--jobs", "1"]
    assert check_cli(argv, monkeypatch, results) == 1, "the deploy gate fails"
    document = json.loads(capsys.readouterr().out)
    aligned = document["kernels"][0]["configs"][0]["gpus"]["L4"]["specializations"]["aligned"]
    assert (aligned["verdict"], aligned["shared"]) == ("overflows", 131072)
    # The real launch on contiguous tensors (unit inner strides) on an L4 raises exactly that.
    assert launch_on_fake_l4(short_names_matmul, args_for(short_names_matmul, *operands()), BIG,
                             triton_cache) == ("overflows", 131072)


def strided_weight(n, step=16):
    """An (n, n) fp16 view whose strides are both multiples of 16 and neither is 1."""
    return torch.empty(n, n * step, dtype=torch.float16)[:, ::step]


def test_unsure_strides_are_checked_in_each_reading_and_the_worse_counts(monkeypatch, capsys, results,
                                                                         triton_cache):
    kernel = discovered(weight_nk_matmul)
    assert kernel.unit_args == ("sak", "scn") and kernel.unsure_unit_args == ("swn", "swk")
    readings = {spec.name: (spec.unit_guess, spec.guessed_ones) for spec in kernel.specializations}
    assert readings == {"aligned": ("by-order", ("swk",)), "misaligned": ("by-order", ("swk",)),
                        "aligned by-layout": ("by-layout", ("swn",)), "misaligned by-layout": ("by-layout", ("swn",)),
                        "aligned non-unit": ("non-unit", ()), "misaligned non-unit": ("non-unit", ())}

    report = preflight.check([kernel], [L4], exact=True, jobs=1, cache=results)
    a, w, c = operands()
    # Each reading is a real launch: W (N, K) contiguous, W the transpose of a (K, N) one, W strided.
    launches = {"aligned": w, "aligned by-layout": torch.empty(256, 256, dtype=torch.float16).t(),
                "aligned non-unit": strided_weight(256)}
    for spec, weight in launches.items():
        verdict = report.verdict(0, 0, spec, "L4")
        launched = launch_on_fake_l4(weight_nk_matmul, args_for(weight_nk_matmul, a, weight, c), BIG, triton_cache)
        assert (verdict.verdict, verdict.shared) == launched, spec
    assert report.verdict(0, 0, "aligned", "L4").verdict == preflight.OVERFLOWS
    assert not report.fits_everywhere(0, 0, "L4") and report.exit_status == 1, "the worse reading counts"

    summary = preflight.format_summary(report)
    assert "unsure which strides are 1 at launch: swn, swk" in summary
    assert "by argument order: swk = 1, by tile layout ('by-layout'): swn = 1, none of them ('non-unit')" in summary
    assert "--unit sak,swk,scn" in summary
    assert "OVER [aligned]" in preflight.format_table(report)
    document = report.to_json()["kernels"][0]
    assert document["unit_args"] == ["sak", "scn"] and document["unsure_unit_args"] == ["swn", "swk"]
    assert {"name": "aligned by-layout", "aligned": True, "ones": [], "unit_guess": "by-layout",
            "guessed_ones": ["swn"]} in document["specializations"]


def test_the_unit_hint_settles_unsure_strides(monkeypatch, capsys, results):
    kernel = discovered(weight_nk_matmul, unit=["sak", "swk", "scn"])
    assert kernel.unsure_unit_args == () and [spec.name for spec in kernel.specializations] == ["aligned",
                                                                                                "misaligned"]
    target = [f"{__name__}:weight_nk_matmul", "--meta", "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,num_stages=4",
              "--gpu", "L4", "--exact", "--quiet", "--jobs", "1"]
    assert check_cli(target + ["--unit", "sak,swk,scn"], monkeypatch, results) == 0
    out = capsys.readouterr().out
    assert "always 1: sak, swk, scn" in out and "unsure" not in out
    assert check_cli(target + ["--unit", "none"], monkeypatch, results) == 0
    out = capsys.readouterr().out
    assert "always 1" not in out and "unsure" not in out
    # Unsure and --json: the document lists the readings, stderr says what to do.
    assert check_cli(target[:-3] + ["--json"], monkeypatch, results) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kernels"][0]["unsure_unit_args"] == ["swn", "swk"]
    assert "weight_nk_matmul: unsure which strides are 1 at launch: swn, swk" in captured.err
    assert check_cli(target + ["--unit", "sak,nope"], monkeypatch, results) == 2
    assert "--unit names ['nope'], which are not runtime parameters" in capsys.readouterr().err


SOURCES = {
    # the innermost axis addressed without a stride argument: no argument of X or Out is 1 for it
    "rows": ("""
        @triton.jit
        def kernel(X, Out, stride_xm, stride_om, n_cols, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            X += row * stride_xm
            x = tl.load(X + cols, mask=cols < n_cols)
            tl.store(Out + row * stride_om + cols, x, mask=cols < n_cols)
    """, (), ()),
    # 1-D accesses through an offsets local, an int64 cast and a scalar row offset
    "one dimension": ("""
        @triton.jit
        def kernel(X, Out, n, stride_xb, stride_x, stride_o, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(X + tl.program_id(1) * stride_xb + offsets * stride_x.to(tl.int64), mask=offsets < n)
            tl.store(Out + offsets * stride_o, x, mask=offsets < n)
    """, ("stride_x", "stride_o"), ()),
    # pointers built in a @triton.jit helper the kernel calls, and one it returns
    "helpers": ("""
        @triton.jit
        def tile_offsets(rm, rk, s_outer, s_inner):
            return rm[:, None] * s_outer + rk[None, :] * s_inner

        @triton.jit
        def load_tile(base, rm, rk, s_outer, s_inner):
            return tl.load(base + tile_offsets(rm, rk, s_outer, s_inner))

        @triton.jit
        def kernel(A, B, s0, s1, t0, t1, BLOCK: tl.constexpr):
            r = tl.arange(0, BLOCK)
            a = load_tile(A, r, r, s0, s1)
            tl.store(B + r[:, None] * t0 + r[None, :] * t1, a)
    """, ("s1", "t1"), ()),
    # block pointers and tensor descriptors name their strides in order, with order=
    "descriptors": ("""
        @triton.jit
        def kernel(A, B, M, K, sam, sak, sbk, sbn, BLOCK: tl.constexpr):
            a = tl.load(tl.make_block_ptr(A, (M, K), (sam, sak), (0, 0), (BLOCK, BLOCK), order=(1, 0)))
            b = tl.make_block_ptr(base=B, shape=(K, M), strides=(sbk, sbn), offsets=(0, 0),
                                  block_shape=(BLOCK, BLOCK), order=(0, 1))
            tl.store(b, a)
    """, ("sak", "sbk"), ()),
    # a column loaded along its rows: the stride of the only vector offset is not the last of X's
    "column": ("""
        @triton.jit
        def kernel(X, Out, Mean, stride_xm, stride_xn, stride_mean, BLOCK: tl.constexpr):
            rows = tl.arange(0, BLOCK)
            x = tl.load(X + rows * stride_xm + tl.program_id(0) * stride_xn)
            mean = tl.load(Mean + tl.program_id(0) * stride_mean)
            tl.store(Out + rows, x - mean)
    """, (), ("stride_xm", "stride_xn")),
    # the order's last stride of X is not on the tile's last axis: unsure
    "transposed": ("""
        @triton.jit
        def kernel(X, Out, sxa, sxb, soa, sob, BLOCK: tl.constexpr):
            r = tl.arange(0, BLOCK)
            x = tl.load(X + r[None, :] * sxa + r[:, None] * sxb)
            tl.store(Out + r[:, None] * soa + r[None, :] * sob, x)
    """, ("sob",), ("sxa", "sxb")),
}


@pytest.mark.parametrize("case", list(SOURCES))
def test_unit_strides_are_read_from_how_the_kernel_uses_its_arguments(case, tmp_path):
    text, sure, unsure = SOURCES[case]
    path = tmp_path / f"strides_{case.replace(' ', '_')}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + textwrap.dedent(text))
    [kernel] = preflight.discover([f"{path}:kernel"], overrides={"configs": [dict(BLOCK=32)]})
    assert (kernel.unit_args, kernel.unsure_unit_args) == (sure, unsure)
    assert {kernel.types[name] for name in ("X", "Out") if name in kernel.types} <= {"*fp16"}
