"""Torch versions of kernels that smemguard substitutes when the real one cannot run.

``batch_invariant_mm`` stands in for vLLM's batch-invariant ``matmul_kernel_persistent``
(see :mod:`smemguard.patches.contrib.vllm_batch_invariant`).

``cublas_mm`` stands in for FlagGems' Triton matmuls (see :mod:`smemguard.patches.contrib.flaggems`).

``sglang_extend_attention`` and ``sglang_context_attention`` compute SGLang's Triton extend and prefill attention
(``extend_attention_fwd``, ``context_attention_fwd``) in torch, for the calls where not even the smallest tiles fit
(see :mod:`smemguard.patches.contrib.sglang_extend_attention`); each declines (``NotImplemented``) the options it does
not
compute.

``paged_mqa_logits_metadata`` stands in for DeepGEMM's ``get_paged_mqa_logits_metadata``,
which vLLM calls (through ``vllm.utils.deep_gemm``) on every decode step of the DeepSeek
sparse-attention indexer to split the paged-MQA-logits work across SMs. Why it needs a
stand-in: DeepGEMM builds that scheduler with per-request arrays in shared memory, so a large
decode batch either fails to compile (DeepGEMM <= 2.5.0 before commit 88965b0: static
``__shared__`` arrays, NVCC refuses more than 48 KiB) or trips DeepGEMM's host assertion on
the shared-memory size (dynamic shared memory, since 88965b0). The schedule itself is a
prefix sum and a binary search, cheap in torch, and the numbers are a pure function of the
context lengths, so the torch version is exact (see :func:`paged_mqa_logits_metadata`).
:mod:`smemguard.patches.contrib.deepgemm_metadata` calls it when DeepGEMM refuses a batch.

Read against deepseek-ai/DeepGEMM's metadata kernel and its host code, 2.0.0 to 2.6.1, and NVIDIA's
``nv_dev`` branch (releases: docs/MEASURED.md, smemguard/fallbacks.py).
"""

from __future__ import annotations

import torch

#: KV tokens per work unit ("split") of every schedule below: DeepGEMM's host code fixes
#: ``split_kv = 256`` since 2.4; before that it was ``4 * block_kv``, also 256 for the
#: 64-token pages SM90 requires.
SPLIT_KV = 256

#: The schedules DeepGEMM has shipped; see :func:`paged_mqa_logits_metadata`.
VARIANTS = ("current", "older", "nv_dev", "sm100")


def paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int, *,
                              variant: str = "current") -> torch.Tensor:
    """DeepGEMM's paged-MQA-logits schedule: int32 ``[num_sms + 1, 2]`` on ``context_lens``' device.

    ``context_lens`` is int ``[B, next_n]`` (only the last column is read: the longest
    context of each request) or ``[B]`` (``next_n = 1``), non-negative. ``block_kv`` is the
    KV page size, which must divide 256 as DeepGEMM asserts; it does not change the schedule.
    Pass vLLM's slot count as ``num_sms`` when it differs from the SM count.

    Request ``b`` has ``segs[b] = ceil(len[b] / 256)`` KV splits; each split is done once per
    *atom* of two query rows, ``atoms = ceil(next_n / 2)`` (1 for next_n 1 and 2). Work units
    are ordered by request, then atom, then split; their total ``T`` is dealt to the SMs in
    contiguous runs of ``T // num_sms`` or one more. Row ``sm`` is where SM ``sm`` starts, as
    ``(request * atoms + atom, split)``; row ``sm + 1`` is where it stops; the last row is
    ``(B * atoms, 0)``. Variants (each exact for the DeepGEMM it names):

    - ``"current"``: the last ``T % num_sms`` SMs take the extra unit, so SMs left without
      work point at the first request that has some. DeepGEMM main 88965b0 (2.5.0,
      2026-06-01) to 54e2261 (2.6.1, SM90 kernel; SM100 too before 54e2261).
    - ``"older"``: the first ``T % num_sms`` SMs take the extra unit; idle SMs point past
      the end, at ``(B * atoms, 0)``. DeepGEMM 891d57b (2.5.0, 2026-04-24) and every
      release back to 2.0.0 when ``next_n <= 2`` and ``block_kv == 64`` (2.0-2.3 had no
      atoms and split ``4 * block_kv``; 2.4.2 used ``next_n`` atoms for odd ``next_n``).
    - ``"nv_dev"``: ``"current"``, except that when no request has work every SM row is
      ``((B - 1) * atoms, 0)``. NVIDIA's nv_dev branch of DeepGEMM (PR #353, 2026-06-04),
      for ``next_n <= 2`` on SM90 (there it passes one atom) and any ``next_n`` on SM100.
    - ``"sm100"``: DeepGEMM 54e2261's Blackwell kernel, weighted by query tokens: request
      ``b`` owns ``segs[b] * next_n`` units, the first SMs take the extra unit, and rows are
      ``(b * next_n, unit_in_request // next_n)``, past the end ``(B * next_n, 0)``.

    Tensor operations only (one cumsum, one searchsorted, integer arithmetic, no reads back
    to the host), so the result is ready without a synchronisation and the call can be
    captured in a CUDA graph. Counts are int64 here, where DeepGEMM's are uint32: they differ
    only past 2**32 work units.
    """
    _check(context_lens, block_kv, num_sms, variant)
    next_n = context_lens.shape[1] if context_lens.dim() == 2 else 1
    lens = (context_lens[:, -1] if context_lens.dim() == 2 else context_lens).to(torch.int64)
    segs = (lens + (SPLIT_KV - 1)) // SPLIT_KV
    sm = torch.arange(num_sms + 1, device=context_lens.device, dtype=torch.int64)
    if variant == "sm100":
        return _token_weighted(segs, next_n, sm, num_sms)
    return _atom_ordered(segs, next_n, sm, num_sms, variant)


def _atom_ordered(segs: torch.Tensor, next_n: int, sm: torch.Tensor, num_sms: int, variant: str) -> torch.Tensor:
    """The ``"current"``, ``"older"`` and ``"nv_dev"`` schedules: units by request, atom, then split."""
    atoms = (next_n + 1) // 2
    units = segs * atoms
    ends = torch.cumsum(units, 0)  # ends[b]: units of requests 0..b
    before = _prepend_zero(ends)  # before[b]: units of requests 0..b-1; before[batch]: all
    batch = segs.shape[0]
    total = before[batch]
    quota, extra = total // num_sms, total % num_sms
    if variant == "older":
        first = sm * quota + torch.minimum(sm, extra)
    else:
        first = sm * quota + torch.clamp_min(sm - (num_sms - extra), 0)
    owner = torch.searchsorted(ends, first, right=True)  # first request ending after `first`
    if variant == "nv_dev":
        # DeepGEMM clamps the SM rows only; the sentinel row stays one past the end.
        owner = torch.minimum(owner, torch.where(sm < num_sms, batch - 1, batch))
    offset = first - before[owner]
    owner_segs = _append_zero(segs)[owner]
    has_work = owner_segs > 0
    divisor = torch.clamp_min(owner_segs, 1)
    atom = torch.where(has_work, offset // divisor, 0)
    split = torch.where(has_work, offset % divisor, 0)
    return torch.stack((owner * atoms + atom, split), dim=1).to(torch.int32)


def _token_weighted(segs: torch.Tensor, next_n: int, sm: torch.Tensor, num_sms: int) -> torch.Tensor:
    ends = torch.cumsum(segs * next_n, 0)
    before = _prepend_zero(ends)
    total = before[segs.shape[0]]
    quota, extra = total // num_sms, total % num_sms
    first = sm * quota + torch.minimum(sm, extra)
    owner = torch.searchsorted(ends, first, right=True)
    split = (first - before[owner]) // next_n
    return torch.stack((owner * next_n, split), dim=1).to(torch.int32)


def _prepend_zero(values: torch.Tensor) -> torch.Tensor:
    return torch.cat((values.new_zeros(1), values))


def _append_zero(values: torch.Tensor) -> torch.Tensor:
    return torch.cat((values, values.new_zeros(1)))


def _check(context_lens, block_kv, num_sms, variant) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, not {variant!r}")
    if not isinstance(context_lens, torch.Tensor):
        raise TypeError(f"context_lens must be a torch.Tensor, not {type(context_lens).__name__}")
    if context_lens.dtype.is_floating_point or context_lens.dtype.is_complex or context_lens.dtype == torch.bool:
        raise TypeError(f"context_lens must hold integers (DeepGEMM takes int32), not {context_lens.dtype}")
    if context_lens.dim() not in (1, 2):
        raise ValueError(f"context_lens must be [batch] or [batch, next_n], not shape {tuple(context_lens.shape)}")
    if context_lens.shape[0] == 0 or (context_lens.dim() == 2 and context_lens.shape[1] == 0):
        raise ValueError(f"context_lens must hold at least one request and one query row, "
                         f"not shape {tuple(context_lens.shape)}")
    for name, value in (("block_kv", block_kv), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, not {value!r}")
    if SPLIT_KV % block_kv:
        raise ValueError(f"block_kv must divide {SPLIT_KV} (DeepGEMM asserts split_kv % block_kv == 0), "
                         f"not {block_kv}")


#: Rows per GEMM in :func:`batch_invariant_mm`: every call multiplies blocks of exactly this
#: many rows, so cuBLAS sees one shape whatever the batch size.
BATCH_INVARIANT_ROWS = 128


def batch_invariant_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out = a @ b (+ bias)``, where row ``i`` of ``out`` does not depend on how many rows ``a`` has.

    cuBLAS picks its algorithm (tiles, split-K) from the problem shape, so the same row can
    round differently in a batch of 1 and a batch of 64. Here ``a`` goes through in blocks of
    :data:`BATCH_INVARIANT_ROWS` rows (the last one zero-padded), always with the same shape,
    in float32 with the bias added in float32 before the cast to ``out``'s dtype, as the
    Triton kernel it replaces does. Slower than one GEMM: it is a fallback.

    Each block goes through :func:`cublas_mm`, not ``@``: vLLM's batch-invariant mode
    overrides ``aten::mm``, ``mm.out``, ``matmul`` and ``linear`` with the very kernel this
    replaces, so ``@`` would run it again.
    """
    rows, width = a.shape
    block = a.new_empty((BATCH_INVARIANT_ROWS, width), dtype=torch.float32)
    right = b.to(torch.float32)
    product = a.new_empty((BATCH_INVARIANT_ROWS, right.shape[1]), dtype=torch.float32)
    extra = bias.to(torch.float32) if bias is not None else None
    for start in range(0, rows, BATCH_INVARIANT_ROWS):
        count = min(BATCH_INVARIANT_ROWS, rows - start)
        block[:count] = a[start:start + count]
        block[count:].zero_()  # the padding of a last, partial block (an empty slice otherwise)
        cublas_mm(block, right, product)
        if extra is not None:
            product += extra
        out[start:start + count] = product[:count].to(out.dtype)


def cublas_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` with PyTorch's own GEMM (cuBLAS on CUDA), even where ``aten::mm`` is overridden.

    FlagGems registers its Triton matmul as the CUDA kernel of ``aten::mm``, ``mm.out``,
    ``addmm``, ``bmm`` and their relatives, and vLLM's batch-invariant mode registers its
    persistent matmul for ``aten::mm``, ``mm.out``, ``addmm``, ``matmul`` and ``linear``, so
    ``torch.mm`` inside a fallback for such a kernel would run the kernel that just failed.
    ``aten::mm.dtype_out`` (the ``out_dtype=`` overload of ``torch.mm``) is overridden by
    neither: on CUDA it goes straight to PyTorch's cuBLAS path. Operands of another dtype than
    ``out`` are cast first, as FlagGems' kernel does.
    Libraries register their overrides for the device's dispatch key only, so on the CPU this
    is ``torch.mm``.
    """
    a, b = a.to(out.dtype), b.to(out.dtype)
    if out.device.type == "cuda":
        torch.ops.aten.mm.dtype_out(a, b, out.dtype, out=out)
    else:
        torch.mm(a, b, out=out)


#: Scores held at once by the attention fallbacks (fp32 elements: 256 MiB); longer sequences go by query rows.
ATTENTION_SCORES = 1 << 26


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, logit_cap: float,
            sees: int | None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` of one sequence in float32: q ``(m, H, D)``, k ``(n, Hkv, D)``, v ``(n, Hkv, Dv)``
    with ``H`` a multiple of ``Hkv`` (grouped queries). Query row ``i`` sees key ``j`` iff ``j <= i + sees`` (None:
    every key); ``logit_cap > 0`` caps the scores with ``tanh`` as SGLang's kernels do."""
    rows, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, n, D)
    values = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, n, Dv)
    out = q.new_empty((rows, heads, v.shape[-1]), dtype=torch.float32)
    step = max(1, ATTENTION_SCORES // max(1, heads * keys.shape[1]))
    for start in range(0, rows, step):
        chunk = q[start:start + step].float().transpose(0, 1)  # (H, r, D)
        scores = torch.matmul(chunk, keys.transpose(1, 2)) * scale  # (H, r, n)
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        if sees is not None:
            row = torch.arange(start, start + chunk.shape[1], device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(keys.shape[1], device=q.device)[None, :] > row + sees,
                                        float("-inf"))
        out[start:start + step] = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(0, 1)
    return out


def sglang_extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                            kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale=1.0,
                            v_scale=1.0, sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True,
                            sliding_window_size=-1, sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
                            lse_extend=None, skip_prefix=False, skip_extend=False, page_size=1, score_mod=None,
                            aux_tensors=None, extend_seq_lens_cpu=None, identity_kv_indices=False, **newer):
    """SGLang 0.5's ``extend_attention_fwd`` in torch: for each sequence, its extend queries attend to its prefix
    (``k_buffer``/``v_buffer`` rows ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, scaled by
    ``k_scale``/``v_scale``, which releases before 0.5.10 do not take: unscaled) and to its own extend keys
    (causally when ``is_causal``); written into ``o_extend``. Declines a custom mask, a sliding window, sinks, XAI
    temperature, the LSE output, skipped parts, paged buffers, a score mod and any argument of a newer release."""
    if (newer or custom_mask is not None or sliding_window_size > 0 or sinks is not None or xai_temperature_len > 0
            or lse_extend is not None or skip_prefix or skip_extend or page_size != 1 or score_mod is not None
            or q_extend.shape[-1] != k_extend.shape[-1]):
        return NotImplemented
    scale = sm_scale or 1.0 / q_extend.shape[-1] ** 0.5
    queries, prefixes = qo_indptr.tolist(), kv_indptr.tolist()
    for sequence in range(len(queries) - 1):
        rows = slice(queries[sequence], queries[sequence + 1])
        prefix = kv_indices[prefixes[sequence]:prefixes[sequence + 1]].long()
        k = torch.cat([k_buffer[prefix].float() * k_scale, k_extend[rows].float()])
        v = torch.cat([v_buffer[prefix].float() * v_scale, v_extend[rows].float()])
        o_extend[rows] = _attend(q_extend[rows], k, v, scale=scale, logit_cap=logit_cap,
                                 sees=len(prefix) if is_causal else None).to(o_extend.dtype)
    return None


def sglang_context_attention(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, sm_scale=None,
                             **newer):
    """SGLang 0.5's ``context_attention_fwd`` (prefill without a prefix) in torch: each sequence's rows
    ``b_start_loc[i]`` onwards, ``b_seq_len[i]`` of them, attend to each other (causally when ``is_causal``)."""
    if newer:
        return NotImplemented
    scale = sm_scale or 1.0 / q.shape[-1] ** 0.5
    for start, length in zip(b_start_loc.tolist(), b_seq_len.tolist()):
        rows = slice(start, start + length)
        o[rows] = _attend(q[rows], k[rows], v[rows], scale=scale, logit_cap=0.0,
                          sees=0 if is_causal else None).to(o.dtype)
    return None
