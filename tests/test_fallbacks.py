"""smemguard.fallbacks.paged_mqa_logits_metadata against a plain loop simulation of DeepGEMM's schedule."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smemguard.fallbacks import VARIANTS, paged_mqa_logits_metadata

SPLIT = 256
SM_COUNTS = (78, 132, 148)  # H20, H100/H200, B200


def reference_schedule(lens_2d: list[list[int]], num_sms: int, variant: str) -> list[list[int]]:
    """The schedule by simulation: deal each SM its quota of work units, then walk the requests
    (and, inside one, its atoms and splits) to the unit where each SM starts."""
    batch, next_n = len(lens_2d), len(lens_2d[0])
    splits = [-(-row[-1] // SPLIT) for row in lens_2d]  # the longest context of each request decides
    if variant == "sm100":
        groups, group_units = next_n, splits  # per request: next_n query tokens, each over every split
    else:
        groups = 1 if next_n == 1 else -(-next_n // 2)  # atoms of two query rows
        group_units = splits
    units = [g * groups for g in group_units]
    total = sum(units)

    quota = [total // num_sms] * num_sms
    extra = total % num_sms
    takers = range(num_sms - extra, num_sms) if variant in ("current", "nv_dev") else range(extra)
    for sm in takers:
        quota[sm] += 1

    rows, request, units_before, position = [], 0, 0, 0
    for sm in range(num_sms):
        while request < batch and units_before + units[request] <= position:
            units_before += units[request]
            request += 1
        if request == batch:
            rows.append([batch * groups, 0])
        elif variant == "sm100":
            rows.append([request * next_n, (position - units_before) // next_n])
        else:
            unit, atom = position - units_before, 0
            while unit >= splits[request]:
                unit -= splits[request]
                atom += 1
            rows.append([request * groups + atom, unit])
        position += quota[sm]
    if variant == "nv_dev" and total == 0:
        rows = [[(batch - 1) * groups, 0]] * num_sms
    return rows + [[batch * groups, 0]]


def random_context_lens(generator: torch.Generator, batch: int, next_n: int) -> torch.Tensor:
    """[batch, next_n] int32 as vLLM builds them: row j of a request sees (next_n - 1 - j) fewer tokens."""
    style = int(torch.randint(0, 6, (1,), generator=generator))
    high = (300, 2_000, 70_000, 300_000, 600, 70_000)[style]
    longest = torch.randint(0, high, (batch,), generator=generator)
    if style >= 4:  # many zero-length requests
        longest[torch.rand(batch, generator=generator) < 0.6] = 0
    shortfall = torch.arange(next_n - 1, -1, -1)
    return (longest[:, None] - shortfall).clamp_min(0).to(torch.int32)


def random_cases(seed: int, count: int):
    generator = torch.Generator().manual_seed(seed)
    batches = torch.randint(1, 65, (count,), generator=generator)
    batches[: count // 10] = torch.randint(65, 4_097, (count // 10,), generator=generator)
    batches[:4] = torch.tensor([65_536, 58_113, 32_768, 12_289])
    for case, batch in enumerate(batches.tolist()):
        next_n = 1 + case % 2
        lens = random_context_lens(generator, batch, next_n)
        if case % 17 == 0:
            lens.zero_()  # a batch where no request has work
        yield lens, SM_COUNTS[case % 3]


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_the_loop_simulation_on_random_batches(variant):
    mismatches = []
    for lens, num_sms in random_cases(seed=1234 + VARIANTS.index(variant), count=1500):
        got = paged_mqa_logits_metadata(lens, 64, num_sms, variant=variant).tolist()
        expected = reference_schedule(lens.tolist(), num_sms, variant)
        if got != expected:
            mismatches.append((tuple(lens.shape), num_sms))
    assert mismatches == []


def test_covers_what_the_acceptance_asks():
    cases = list(random_cases(seed=1234, count=1500))
    batches = {lens.shape[0] for lens, _ in cases}
    assert min(batches) == 1 and max(batches) == 65_536
    assert {lens.shape[1] for lens, _ in cases} == {1, 2}
    assert {num_sms for _, num_sms in cases} == set(SM_COUNTS)
    assert any(not lens.any() for lens, _ in cases)  # all-zero batches
    assert any((lens[:, -1] == 0).any() and lens.any() for lens, _ in cases)  # some zero-length requests


@pytest.mark.parametrize("variant, expected", [
    # One request with 5 splits on 4 SMs: 1 unit each plus one extra, to the last SM or to the first.
    ("current", [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]),
    ("nv_dev", [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]),
    ("older", [[0, 0], [0, 2], [0, 3], [0, 4], [1, 0]]),
    ("sm100", [[0, 0], [0, 2], [0, 3], [0, 4], [1, 0]]),
])
def test_where_the_extra_unit_goes(variant, expected):
    lens = torch.tensor([[5 * SPLIT]], dtype=torch.int32)
    assert paged_mqa_logits_metadata(lens, 64, 4, variant=variant).tolist() == expected


@pytest.mark.parametrize("variant, expected", [
    # Two units (2 atoms x 1 split) on 4 SMs: idle SMs point at the first work, or past the end.
    ("current", [[0, 0], [0, 0], [0, 0], [1, 0], [2, 0]]),
    ("older", [[0, 0], [1, 0], [2, 0], [2, 0], [2, 0]]),
    # Token-weighted: 4 tokens x 1 split = 4 units, one per SM, all in split 0 of request 0.
    ("sm100", [[0, 0], [0, 0], [0, 0], [0, 0], [4, 0]]),
])
def test_next_n_4_uses_two_atoms(variant, expected):
    lens = torch.tensor([[253, 254, 255, 256]], dtype=torch.int32)
    assert paged_mqa_logits_metadata(lens, 64, 4, variant=variant).tolist() == expected


def test_zero_length_requests_own_no_work():
    lens = torch.tensor([[0], [300], [0], [0], [600], [0]], dtype=torch.int32)  # 2 + 3 splits
    assert paged_mqa_logits_metadata(lens, 64, 5).tolist() == [[1, 0], [1, 1], [4, 0], [4, 1], [4, 2], [6, 0]]


@pytest.mark.parametrize("variant, sm_row", [("current", [3, 0]), ("older", [3, 0]), ("nv_dev", [2, 0]),
                                             ("sm100", [3, 0])])
def test_all_empty_batch(variant, sm_row):
    lens = torch.zeros(3, 1, dtype=torch.int32)
    assert paged_mqa_logits_metadata(lens, 64, 4, variant=variant).tolist() == [sm_row] * 4 + [[3, 0]]


def test_one_dimensional_and_int64_lens_give_the_same_schedule():
    lens = random_context_lens(torch.Generator().manual_seed(7), 500, 1)
    expected = paged_mqa_logits_metadata(lens, 64, 132)
    assert torch.equal(paged_mqa_logits_metadata(lens[:, 0], 64, 132), expected)
    assert torch.equal(paged_mqa_logits_metadata(lens.to(torch.int64), 64, 132), expected)
    assert torch.equal(paged_mqa_logits_metadata(lens, 32, 132), expected)  # the page size does not matter


def test_only_the_last_query_row_counts():
    lens = torch.tensor([[0, 1000], [1000, 0]], dtype=torch.int32)
    assert paged_mqa_logits_metadata(lens, 64, 4).tolist() == reference_schedule([[1000], [0]], 4, "current")


def test_result_is_int32_on_the_input_device():
    result = paged_mqa_logits_metadata(torch.ones(10, 2, dtype=torch.int32), 64, 132)
    assert result.dtype == torch.int32 and result.shape == (133, 2) and result.device == torch.device("cpu")
    assert result.is_contiguous()


@pytest.mark.parametrize("call, error, words", [
    (lambda: paged_mqa_logits_metadata(torch.ones(4, 1, dtype=torch.int32), 64, 132, variant="newest"),
     ValueError, "variant must be one of"),
    (lambda: paged_mqa_logits_metadata(torch.ones(4, 1), 64, 132), TypeError, "must hold integers"),
    (lambda: paged_mqa_logits_metadata(torch.ones(4, 1, dtype=torch.bool), 64, 132), TypeError, "integers"),
    (lambda: paged_mqa_logits_metadata([1, 2], 64, 132), TypeError, "must be a torch.Tensor"),
    (lambda: paged_mqa_logits_metadata(torch.ones(2, 2, 2, dtype=torch.int32), 64, 132), ValueError, "[batch]"),
    (lambda: paged_mqa_logits_metadata(torch.ones(0, 1, dtype=torch.int32), 64, 132), ValueError, "one request"),
    (lambda: paged_mqa_logits_metadata(torch.ones(3, 0, dtype=torch.int32), 64, 132), ValueError, "query row"),
    (lambda: paged_mqa_logits_metadata(torch.ones(4, 1, dtype=torch.int32), 48, 132), ValueError, "divide 256"),
    (lambda: paged_mqa_logits_metadata(torch.ones(4, 1, dtype=torch.int32), 64, 0), ValueError, "num_sms"),
    (lambda: paged_mqa_logits_metadata(torch.ones(4, 1, dtype=torch.int32), True, 132), ValueError, "block_kv"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error) as raised:
        call()
    assert words in str(raised.value)


class _NoHostReads(TorchDispatchMode):
    """Fails on every op that reads tensor data back to the host or sizes a result by the data."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "_assert_async")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if any(word in name for word in self.FORBIDDEN):
            raise AssertionError(f"host synchronisation: {name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_host_synchronisation(variant):
    lens = random_context_lens(torch.Generator().manual_seed(3), 300, 2)
    with _NoHostReads():
        result = paged_mqa_logits_metadata(lens, 64, 132, variant=variant)
    assert result.tolist() == reference_schedule(lens.tolist(), 132, variant)
    # Meta tensors have no data at all: any read (.item(), .tolist(), bool()) raises.
    meta = paged_mqa_logits_metadata(torch.empty(4096, 2, dtype=torch.int32, device="meta"), 64, 132,
                                     variant=variant)
    assert meta.device.type == "meta" and meta.shape == (133, 2) and meta.dtype == torch.int32


def test_the_no_sync_check_catches_a_host_read():
    with pytest.raises(AssertionError, match="host synchronisation"):
        with _NoHostReads():
            int(torch.ones(3).sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_graph_capture_and_replay(variant):
    generator = torch.Generator().manual_seed(11)
    lens = random_context_lens(generator, 4096, 2).cuda()
    paged_mqa_logits_metadata(lens, 64, 132, variant=variant)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_mqa_logits_metadata(lens, 64, 132, variant=variant)
    for _ in range(3):
        fresh = random_context_lens(generator, 4096, 2)
        lens.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert captured.tolist() == reference_schedule(fresh.tolist(), 132, variant)


def test_batch_invariant_mm_rows_do_not_depend_on_the_batch():
    from smemguard.fallbacks import batch_invariant_mm

    generator = torch.Generator().manual_seed(7)
    a = torch.randn(300, 96, generator=generator).half()
    b = torch.randn(96, 5, generator=generator).half()
    bias = torch.randn(5, generator=generator).half()
    batch = torch.full((300, 5), float("nan"), dtype=torch.float16)
    batch_invariant_mm(a, b, batch, bias)
    for row in range(0, 300, 37):
        single = torch.full((1, 5), float("nan"), dtype=torch.float16)
        batch_invariant_mm(a[row: row + 1], b, single, bias)
        assert torch.equal(single[0], batch[row])
    reference = (a.double() @ b.double() + bias.double()).half()
    assert torch.allclose(batch.float(), reference.float(), atol=1e-2)
