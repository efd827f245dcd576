"""A library pack applies to the library's kernel by what its safety argument reads, wherever a release keeps it
(``patches.Kernels``): at an older release's home as at the newest, and at no kernel that misses something the
argument reads (its parameters, its tiles sizing its blocks, masks on what the tiles index, the wrapper that computes
the grid from the tile), which gets one line and is left as the library wrote it. Stand-ins of SGLang's prefill
attention (tests/test_sglang.py drives the real kernels of SGLang 0.5.5 and 0.5.23); the masks are read from the
kernels' source (``smemguard.kernels.tails``)."""

import json
import textwrap

import pytest
import triton
import triton.language as tl

from smemguard.kernels import tails

from conftest import run_python

OLD_HOME = "sglang.srt.layers.attention.triton_ops.prefill_attention"
NEW_HOME = "sglang.kernels.ops.attention.prefill_attention"

#: SGLang's prefill kernel, reduced to what the pack reads: its parameters, its tiles sizing blocks, its masks.
KERNEL = """
    import triton
    import triton.language as tl

    @triton.jit
    def _fwd_kernel(Q, Out, B_Start_Loc, B_Seqlen, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, Lk: tl.constexpr):
        length = tl.load(B_Seqlen)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + offs_m, mask=offs_m < length, other=0.0)
        k = tl.load(Q + offs_n, mask=offs_n < length, other=0.0)
        tl.store(Out + offs_m, q + tl.sum(k), mask=offs_m < length)

    def context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True):
        BLOCK = 128
        _fwd_kernel[(1,)](q, o, b_start_loc, b_seq_len, IS_CAUSAL=is_causal, BLOCK_M=BLOCK, BLOCK_N=BLOCK, Lk=64)
    """


def stand_in(root, home: str, kernel: str = KERNEL, version: str = "0.5.5") -> None:
    """A package holding ``kernel``'s module at ``home`` (SGLang ``version``)."""
    parts = home.split(".")
    for level in range(1, len(parts)):
        package = root.joinpath(*parts[:level])
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(f"__version__ = {version!r}\n" if level == 1 else "")
    root.joinpath(*parts[:-1], f"{parts[-1]}.py").write_text(textwrap.dedent(kernel))


def install_and_import(root, home: str):
    """In a fresh process (the stand-in first on its path, shadowing an SGLang installed here): install, import
    ``home`` (twice, as a library's imports would), and say what the pack did; the log lines at WARNING and above on
    stderr."""
    return run_python(f"""
        import importlib, json, logging, sys
        sys.path.insert(0, {str(root)!r})
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        import triton, smemguard
        from smemguard.patches.contrib import sglang_prefill_attention as pack
        smemguard.install()
        module = importlib.import_module({home!r})
        own = module.__dict__["context_attention_fwd"]
        pack.PATCH.patch(smemguard.guard.installed_engine())  # a second import of one of its modules
        print(json.dumps({{"patched": pack.PATCH.is_patched(), "wrapper_layered": hasattr(own, "__wrapped__"),
                          "target": next((t for t in pack.PATCH.targets if t.startswith({home!r})), None)}}))
    """)


def test_the_pack_applies_at_the_home_of_an_older_release(tmp_path):
    """SGLang 0.5.5 keeps the kernel in ``sglang.srt.layers.attention.triton_ops``: patched there, as at 0.5.23's."""
    for release, home in (("0.5.5", OLD_HOME), ("0.5.23", NEW_HOME)):
        root = tmp_path / release
        stand_in(root, home, version=release)
        result = install_and_import(root, home)
        seen = json.loads(result.stdout.splitlines()[-1])
        assert seen == {"patched": True, "wrapper_layered": True, "target": f"{home}.context_attention_fwd"}, release
        assert "WARNING" not in result.stderr, result.stderr


@pytest.mark.parametrize(("change", "said"), [
    (("q = tl.load(Q + offs_m, mask=offs_m < length, other=0.0)", "q = tl.load(Q + offs_m)"),
     "_fwd_kernel loads or stores without a mask at _fwd_kernel line 11 (indexed by BLOCK_M)"),
    (("k = tl.load(Q + offs_n, mask=offs_n < length, other=0.0)", "k = tl.load(Q + offs_n, mask=None)"),
     "_fwd_kernel loads or stores without a mask at _fwd_kernel line 12 (indexed by BLOCK_N)"),
    (("B_Seqlen, IS_CAUSAL", "B_Lengths, IS_CAUSAL"), "_fwd_kernel has no parameter B_Seqlen"),
    (("offs_n = tl.arange(0, BLOCK_N)", "offs_n = tl.arange(0, 16) + BLOCK_N"),
     "_fwd_kernel sizes no block with BLOCK_N"),
    (("        BLOCK = 128\n", "        TILE = 128\n"),
     "it does not have context_attention_fwd choosing BLOCK and launching _fwd_kernel with it"),
])
def test_a_kernel_missing_what_the_argument_reads_is_left_as_written_with_one_line(tmp_path, change, said):
    old, new = change
    kernel = textwrap.dedent(KERNEL)
    assert textwrap.dedent(old).strip() in kernel
    stand_in(tmp_path, OLD_HOME, kernel.replace(textwrap.dedent(old).strip(), textwrap.dedent(new).strip()))
    result = install_and_import(tmp_path, OLD_HOME)
    seen = json.loads(result.stdout.splitlines()[-1])
    assert (seen["patched"], seen["wrapper_layered"]) == (False, False)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == (f"WARNING smemguard: sglang_prefill_attention is not applied to {OLD_HOME}: {said}, which its "
                        "safety argument reads; it runs as the library wrote it")


def test_a_build_without_triton_is_no_home_and_nothing_is_said(tmp_path):
    """A build whose Triton is disabled defines the kernel as a plain function: not patched, no line."""
    stand_in(tmp_path, NEW_HOME, "def _fwd_kernel(*args, **kwargs):\n    pass\n\n"
                                 "def context_attention_fwd(*args, **kwargs):\n    BLOCK = 64\n")
    result = install_and_import(tmp_path, NEW_HOME)
    assert json.loads(result.stdout.splitlines()[-1])["patched"] is False
    assert "WARNING" not in result.stderr, result.stderr


# -- the masks, read from the source -------------------------------------------------------------------------

@triton.jit
def _checked(pointer, check: tl.constexpr):
    if check is not None:
        return tl.load(pointer, boundary_check=check, padding_option="zero")
    else:
        return tl.load(pointer)


@triton.jit
def _tiled(X, Y, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    masked = tl.load(X + rows, mask=rows < n)
    offset = tl.load(X + n)  # a scalar: no tile indexes it
    checked = tl.make_block_ptr(X, (n, n), (n, 1), (0, 0), (BLOCK_M, BLOCK_N), (1, 0))
    whole = tl.make_block_ptr(Y, (n, n), (n, 1), (0, 0), (BLOCK_K, BLOCK_K), (1, 0))
    total = tl.sum(_checked(checked, (0, 1))) + tl.sum(_checked(whole, None))
    unmasked = tl.load(Y + tl.arange(0, BLOCK_N) + offset)
    tl.store(Y + rows, masked + total + tl.sum(unmasked), mask=rows < n)


def test_unmasked_reads_each_access_a_tile_indexes_without_a_mask():
    """A masked load, a scalar one, a block pointer read through a helper with a boundary check and one without
    (its literal ``None`` takes the helper's unchecked branch), and an unmasked load: two found, each with the tiles
    that index it, at its own line."""
    first = _tiled.fn.__code__.co_firstlineno
    found = {(access.function, access.tiles) for access in tails.unmasked(_tiled)}
    assert found == {("_checked", frozenset({"BLOCK_K"})), ("_tiled", frozenset({"BLOCK_N"}))}
    [own] = [access for access in tails.unmasked(_tiled) if access.function == "_tiled"]
    assert own.line == first + 8
