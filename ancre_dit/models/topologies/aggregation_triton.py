"""Triton kernels for the stacked aggregation (`_StackedNode`) on CUDA, imported only when chosen: each
source row read once, summed in fp32, the sum (and its bf16 copy) written once; the weights' gradient in
one pass, each program's Gram partial summed in a fixed order (no atomics: the same result run to run).
Under TRITON_INTERPRET=1 they run on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16)
SUM_BLOCK = 1024
GRAM_PROGRAMS = 1024  # fixed, not per device: the partials, hence the rounding, are the same on every GPU
MAX_ROWS = 128  # the Gram tile holds every row; deeper trunks take the torch product


@triton.jit
def _rounded_for(ptr, x):
    """fp32 `x` in the dtype `ptr` points to, rounded to nearest even like torch's casts. Spelled out
    for bf16: the interpreter's own cast truncates, so it would not test what a GPU computes."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)  # a NaN stays NaN (the carry could clear it)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def _sum_rows_kernel(out_ptr, copy_ptr, base_ptr, base_stride, rows_ptr, index_ptr, weight_ptr, weight_stride, terms, n,
                     HAS_BASE: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    if HAS_BASE:
        acc = tl.load(base_ptr + offs * base_stride, mask=inside, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for e in range(terms):
        i = tl.load(index_ptr + e).to(tl.int64)
        w = tl.load(weight_ptr + i * weight_stride).to(tl.float32)
        acc += w * tl.load(rows_ptr + i * n + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _rounded_for(out_ptr, acc), mask=inside)
    if HAS_COPY:
        tl.store(copy_ptr + offs, _rounded_for(copy_ptr, acc), mask=inside)


@triton.jit
def _gram_kernel(part_ptr, a_ptr, b_ptr, rows, n, tiles, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    r = tl.arange(0, ROWS)
    row_offs = r[:, None].to(tl.int64) * n
    live = (r < rows)[:, None]
    acc = tl.zeros((ROWS, ROWS), dtype=tl.float32)
    for t in range(pid, tiles, programs):
        cols = tl.arange(0, BLOCK).to(tl.int64) + t * BLOCK  # (t * BLOCK < n fits in int32)
        m = live & (cols < n)[None, :]
        a = tl.load(a_ptr + row_offs + cols[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row_offs + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    tl.store(part_ptr + pid.to(tl.int64) * ROWS * ROWS + r[:, None] * ROWS + r[None, :], acc)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors (fp32 / bf16; others stay with the torch ops)."""
    return all(t.dtype in DTYPES for t in tensors)


def sum_rows(into: torch.Tensor, base: torch.Tensor | None, rows: torch.Tensor, index: torch.Tensor,
             weight_line: torch.Tensor, copy_to: torch.Tensor | None = None) -> None:
    """into = base + sum_k weight_line[index[k]] * rows[index[k]] (flat; no base: zero), summed in fp32 in
    that order; `copy_to` (e.g. the bf16 history row) gets the same sum in its own dtype."""
    n, has_base = into.numel(), base is not None
    base = base.reshape(-1) if has_base else into  # a view where one exists (e.g. an expanded gradient)
    grid = (triton.cdiv(n, SUM_BLOCK),)
    _sum_rows_kernel[grid](into, into if copy_to is None else copy_to, base, base.stride(0), rows, index,
                           weight_line, weight_line.stride(0), index.numel(), n, HAS_BASE=has_base,
                           HAS_COPY=copy_to is not None, BLOCK=SUM_BLOCK)


def gram(grads: torch.Tensor, store: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """(K, K) matrix of <grads[r], store[i]>, accumulated in fp32; None if the trunk is deeper than a tile."""
    K, n = grads.shape
    if K > MAX_ROWS:
        return None
    rows = max(16, triton.next_power_of_2(K))  # tl.dot's smallest tile
    block = max(16, 4096 // rows)
    tiles = triton.cdiv(n, block)
    programs = min(tiles, GRAM_PROGRAMS)
    partials = torch.empty((programs, rows, rows), dtype=torch.float32, device=grads.device)
    _gram_kernel[(programs,)](partials, grads, store, K, n, tiles, ROWS=rows, BLOCK=block)
    return partials.sum(0)[:K, :K].to(dtype)
