"""Paged K/V over walshkv codecs: slot writes, block-table reads, decode and prefill attention.

Pure torch and walshkv (no vLLM): the vLLM backend (:mod:`walshkv_vllm.vllm_backend`) calls these with the
tensors vLLM hands it, and the tests call them directly. Conventions are vLLM's:

- tokens are rows: ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]``, ``query``
  ``[num_tokens, num_q_heads, head_dim]``; grouped-query attention maps query head ``h`` to kv head
  ``h // (num_q_heads // num_kv_heads)``;
- the page tensor is ``uint8 [num_blocks, block_size, num_kv_heads, slot_bytes]`` (:mod:`walshkv_vllm.layout`);
- ``slot_mapping[i]`` is token ``i``'s slot ``block * block_size + offset``; ``-1`` marks padding (skipped);
- ``block_table[r, j]`` is the block holding positions ``j * block_size ...`` of request ``r``, ``seq_lens[r]``
  how many positions it has (the tokens being computed included: they are written before attention runs).

Decode hands the pages (as views) and the block table to :func:`walshkv.attention.decode_attention_paged`: one fused
CPU kernel call for all requests where the kernel reads the codecs, one Triton launch on CUDA, else each request's
rows gathered and read by :func:`walshkv.attention.decode_attention`. On CUDA the write (:func:`write_slots`) and
the decode read no value back to the host (checks are device-side asserts), so a CUDA graph can capture them.

Positions and sinks (CPU pages). ``ropeblock:G+`` and ``prerope+`` K turn each key by its position, so the write
takes each token's position (:class:`Places`, from vLLM's metadata: ``seq_lens[r] - q_len + i``) and encodes each
request's run of tokens at its first position, exactly as :meth:`walshkv.codecs.Codec.encode` would with ``start``.
``sink:N:`` keeps positions ``0 .. N-1`` of each sequence in fp16 (:class:`SinkRows`, beside the pages: their
slots hold codes that are never read), and both reads (decode and prefill) then go request by request: the sink
rows first, the packed positions ``N ..`` read with ``start=N``, as :class:`walshkv.cache.CompressedCache` reads
its own cache.

Prefill, per request: a whole prompt is one causal scaled-dot-product attention (torch's fused path); a later chunk
runs :func:`walshkv.attention.chunked_attention`: the cached context decoded tile by tile, each tile through torch's
fused CPU attention (causal within the chunk), merged by log-sum-exp, with no mask of the chunk's queries by every
key. In ``exact`` mode the prompt's own K/V join in full precision (for ``center+`` keys shifted by the same K mean
the decoded keys lack, so every key a query sees is shifted alike); in ``quantized`` mode they are read back from
the pages too.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from walshkv.attention import chunked_attention, decode_attention, decode_attention_paged
from walshkv.codecs import Codec, Packed, checks_on_device, find_wrapper, wrappers
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.center import Centered
from walshkv.codecs.prerope import PreRope

from walshkv_vllm.layout import SlotLayout

__all__ = [
    "Places",
    "SinkRows",
    "decode_paged",
    "is_positional",
    "prefill_paged",
    "read_sequence",
    "write_slots",
]


def is_positional(codec: Codec) -> bool:
    """True if ``codec`` turns K by each token's position (``ropeblock:G+``, ``prerope+``)."""
    return any(isinstance(w, (RopeBlock, PreRope)) for w in wrappers(codec))


@dataclass(frozen=True)
class Places:
    """Where each row of a write sits: its position in its sequence and the block holding the sequence's start.

    Attributes:
        positions: ``[n]`` int64, row ``i``'s position (anything for padding rows, whose slot is ``-1``).
        first_blocks: ``[n]`` int64, the block id of row ``i``'s sequence's position 0 (``block_table[r, 0]``).
    """

    positions: torch.Tensor
    first_blocks: torch.Tensor

    @classmethod
    def of(
        cls,
        query_start_loc: torch.Tensor | list[int],
        seq_lens: torch.Tensor | list[int],
        block_table: torch.Tensor,
        num_rows: int | None = None,
    ) -> Places:
        """The places of a step's rows from vLLM's metadata: request ``r``'s rows ``query_start_loc[r]:
        query_start_loc[r+1]`` are its positions ``seq_lens[r] - q_len ... seq_lens[r] - 1``.

        Args:
            query_start_loc: ``[num_reqs + 1]`` row offsets.
            seq_lens: ``[num_reqs]`` tokens per request, this step's included.
            block_table: ``[num_reqs, max_blocks]``.
            num_rows: rows of the write (``slot_mapping``'s length; rows past the requests' are padding, placed at 0).

        Raises:
            ValueError: offsets that do not rise, a request with more rows than tokens.
        """
        starts = [int(x) for x in query_start_loc]
        lens = [int(x) for x in seq_lens]
        if len(starts) != len(lens) + 1 or any(b < a for a, b in pairwise(starts)):
            raise ValueError(f"query_start_loc {starts} must rise, one entry more than the {len(lens)} requests")
        total = starts[-1] if num_rows is None else max(num_rows, starts[-1])
        positions = torch.zeros(total, dtype=torch.long)
        owner = torch.zeros(total, dtype=torch.long)
        for r, (a, b) in enumerate(pairwise(starts)):
            if b - a > lens[r]:
                raise ValueError(f"request {r} has {b - a} rows but a sequence of only {lens[r]} tokens")
            positions[a:b] = torch.arange(lens[r] - (b - a), lens[r])
            owner[a:b] = r
        first = block_table[: len(lens), 0].to(device="cpu", dtype=torch.long) if lens else owner[:0]
        return cls(positions, first[owner] if total else owner)


class SinkRows:
    """``sink:N:``'s first ``N`` tokens of each sequence in fp16, beside one layer's pages (CPU).

    Keyed by the block that holds a sequence's position 0 (``block_table[r, 0]``): sequences that share a cached
    prefix share that block, and so its rows. With each token it keeps the bytes its slot received, and a read
    compares them with the slot: a block rewritten by anything but this backend's write (a KV connector loading
    blocks it has no sink rows for) is refused, never read with another sequence's sink.

    Args:
        n: sink tokens per sequence (``N``).
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"sink rows hold N >= 1 tokens, got {n!r}")
        self.n = n
        self._rows: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def put(
        self,
        places: Places,
        keep: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        raw: torch.Tensor,
    ) -> None:
        """Keep the rows at positions ``< N``: ``key``/``value`` ``[m, kv_heads, head_dim]`` and their slot bytes
        ``raw [m, kv_heads, slot_bytes]`` for the written rows (``keep``: which of ``places``' rows they are)."""
        positions, blocks = places.positions[keep.cpu()], places.first_blocks[keep.cpu()]
        for i in torch.nonzero(positions < self.n).flatten().tolist():
            entry = self._rows.setdefault(int(blocks[i]), {})
            entry[int(positions[i])] = (
                key[i].to(torch.float16).cpu(),
                value[i].to(torch.float16).cpu(),
                raw[i].cpu().clone(),
            )

    def head(self, pages: torch.Tensor, block: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. count-1`` of the sequence starting in ``block``: K and V ``[1, kv_heads, count, d]``
        (fp16).

        Raises:
            ValueError: a position never written through this backend, or a slot whose bytes are not those
                written with the row (the block was filled by something else).
        """
        entry = self._rows.get(block, {})
        ks, vs = [], []
        for p in range(count):
            row = entry.get(p)
            if row is None or not torch.equal(pages[block, p].cpu(), row[2]):
                raise ValueError(
                    f"sink:{self.n}: position {p} of the sequence in block {block} has no full-precision row written "
                    "with its slot (a block filled by something other than this backend's write, such as a KV "
                    "connector, carries no sink rows); serve sink:N specs without KV connectors, or drop sink:N:"
                )
            ks.append(row[0])
            vs.append(row[1])
        return torch.stack(ks, 1).unsqueeze(0), torch.stack(vs, 1).unsqueeze(0)


def _check_pages(pages: torch.Tensor, layout: SlotLayout) -> None:
    if pages.dtype != torch.uint8 or pages.dim() != 4:
        raise ValueError(
            f"pages must be uint8 [num_blocks, block_size, num_kv_heads, slot_bytes], got {pages.dtype} "
            f"{tuple(pages.shape)}"
        )
    if pages.shape[2] != layout.num_kv_heads or pages.shape[3] != layout.slot_bytes:
        raise ValueError(
            f"pages {tuple(pages.shape)} do not fit the slot layout ({layout.num_kv_heads} kv heads, "
            f"{layout.slot_bytes} bytes a slot); allocate them with the layout's page_shape"
        )


def _check_requests(block_table: torch.Tensor, lens: list[int]) -> None:
    """Refuse a block table with fewer rows than requests, or a negative sequence length."""
    if block_table.dim() != 2 or block_table.shape[0] < len(lens):
        raise ValueError(
            f"block_table {tuple(block_table.shape)} needs a row per request ({len(lens)} requests): "
            "[num_reqs, max_blocks]"
        )
    if any(n < 0 for n in lens):
        raise ValueError(f"sequence lengths are >= 0, got {lens}")


def write_slots(
    pages: torch.Tensor,
    layout: SlotLayout,
    k_codec: Codec,
    v_codec: Codec,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    on_device: bool | None = None,
    places: Places | None = None,
    sinks: SinkRows | None = None,
) -> None:
    """Encode each token's K and V and store them in its slot (in place); slots ``< 0`` are padding, skipped.

    Args:
        pages: ``uint8 [num_blocks, block_size, num_kv_heads, slot_bytes]``, written in place.
        layout: the slot layout of ``k_codec``/``v_codec``.
        k_codec, v_codec: the layer's bound codecs.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` (rows past ``len(slot_mapping)`` are ignored).
        slot_mapping: ``[n]`` int slots, ``n <= num_tokens``.
        on_device: check the values on the device and never read one back to the host (no wait for the GPU, so
            a CUDA graph can capture the write): slot bounds and NaN/Inf become device-side asserts
            (:func:`walshkv.codecs.checks_on_device`), padding rows are written as copies of a real row instead
            of being dropped by a mask. ``None``: on for CUDA pages, off on the CPU (where reading back is free
            and the errors are :class:`ValueError` with the offending slot).
        places: each row's position and sequence start (:class:`Places`, at least ``n`` rows): needed by a
            positional K codec (:func:`is_positional`) and by ``sinks``.
        sinks: the layer's ``sink:N:`` rows, which keep positions ``< N`` in fp16 (CPU pages).

    Raises:
        ValueError: mismatched shapes, a positional codec or sinks without ``places`` (or on device checks), or
            (host checks) a slot past the end of the pages.
        RuntimeError: (device checks, on the CPU at once) a slot past the end of the pages, or NaN/Inf K/V.
    """
    _check_pages(pages, layout)
    n = slot_mapping.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} slots but key/value only {key.shape[0]}/{value.shape[0]} tokens")
    if key.shape[1:] != (layout.num_kv_heads, layout.head_dim) or value.shape[1:] != key.shape[1:]:
        raise ValueError(
            f"key/value must be [num_tokens, {layout.num_kv_heads}, {layout.head_dim}], got "
            f"{tuple(key.shape)}/{tuple(value.shape)}"
        )
    slots = slot_mapping.to(device=pages.device, dtype=torch.long)
    k, v = key[:n], value[:n]
    positional = is_positional(k_codec)
    if (positional or sinks is not None) and (places is None or places.positions.shape[0] < n):
        what = "sink:N: rows" if sinks is not None else f"{k_codec.spec!r} (it turns K by position)"
        raise ValueError(f"{what} need each row's position: pass places (Places.of(...)) for all {n} rows")
    if on_device if on_device is not None else pages.device.type == "cuda":
        if positional or sinks is not None:
            raise ValueError(
                f"{k_codec.spec!r} with sink:N: rows or positions runs on CPU pages only (the device write reads "
                "nothing back to the host); serve it on the CPU, or use a spec without sink:N:, ropeblock+, prerope+"
            )
        _write_on_device(pages, layout, k_codec, v_codec, k, v, slots)
        return
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    if slots.numel() == 0:
        return
    num_blocks, block_size = pages.shape[:2]
    top = int(slots.max())
    if top >= num_blocks * block_size:
        raise ValueError(f"slot {top} is past the pages' {num_blocks} blocks of {block_size} tokens")
    if sinks is not None and sinks.n > block_size:
        raise ValueError(f"sink:{sinks.n}: needs the sink in a sequence's first block, but a block holds {block_size}")
    if positional:
        assert places is not None
        raw = _encode_runs(layout, k_codec, v_codec, k, v, places.positions[:n][keep.cpu()])
    else:
        pk = k_codec.encode(k.transpose(0, 1).unsqueeze(0))  # [1, kv_heads, n, ...]
        pv = v_codec.encode(v.transpose(0, 1).unsqueeze(0))
        raw = layout.to_bytes(pk, pv)[0].transpose(0, 1)  # [n, kv_heads, slot_bytes]
    pages[slots // block_size, slots % block_size] = raw.to(pages.device)
    if sinks is not None:
        assert places is not None
        sinks.put(Places(places.positions[:n], places.first_blocks[:n]), keep, k, v, raw)


def _encode_runs(
    layout: SlotLayout, k_codec: Codec, v_codec: Codec, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Slots ``[n, kv_heads, slot_bytes]`` of rows at ``positions``: each run of consecutive positions (a request's
    rows) encoded at its first position, as ``encode(x, start)`` encodes a sequence."""
    cuts = [0, *(torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist(), len(positions)]
    out = []
    for a, b in pairwise(cuts):
        start = int(positions[a])
        pk = k_codec.encode(k[a:b].transpose(0, 1).unsqueeze(0), start=start)
        pv = v_codec.encode(v[a:b].transpose(0, 1).unsqueeze(0), start=start)
        out.append(layout.to_bytes(pk, pv)[0].transpose(0, 1))
    return torch.cat(out)


def _write_on_device(
    pages: torch.Tensor,
    layout: SlotLayout,
    k_codec: Codec,
    v_codec: Codec,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """:func:`write_slots` with nothing read back to the host. Every row is encoded (padding too: its K/V are
    whatever the engine left there, replaced by zeros so that the NaN check sees only real rows); a padding row
    then writes the bytes of the first real row to that row's slot, so the scatter has a fixed size and two
    writes to one slot always carry the same bytes. With no real row, each padding row rewrites slot 0's bytes."""
    n = slots.shape[0]
    if n == 0:
        return
    num_blocks, block_size = pages.shape[:2]
    keep = slots >= 0
    torch._assert_async(
        (slots < num_blocks * block_size).all(),
        f"slot_mapping names a slot past the pages' {num_blocks} blocks of {block_size} tokens",
    )
    mask = keep[:, None, None]
    k = torch.where(mask, k, torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(mask, v, torch.zeros((), dtype=v.dtype, device=v.device))
    with checks_on_device():
        pk = k_codec.encode(k.transpose(0, 1).unsqueeze(0))  # [1, kv_heads, n, ...]
        pv = v_codec.encode(v.transpose(0, 1).unsqueeze(0))
    raw = layout.to_bytes(pk, pv)[0].transpose(0, 1).to(pages.device)  # [n, kv_heads, slot_bytes]
    # index tensors of shape [1], never 0-d: indexing with a 0-d tensor reads it back to the host
    first = torch.argmax(keep.to(torch.int8)).reshape(1)  # the first real row (0 when there is none)
    any_real = keep.any()
    zero = torch.zeros_like(first)
    target = torch.where(keep, slots, torch.where(any_real, slots.index_select(0, first), zero))
    flat = pages.view(num_blocks * block_size, *pages.shape[2:])
    # the first real row's bytes, or (no real row: every target is slot 0) slot 0's own bytes
    filler = torch.where(any_real, raw.index_select(0, first), flat.index_select(0, zero))
    flat.index_put_((target,), torch.where(keep[:, None, None], raw, filler))


def read_sequence(
    pages: torch.Tensor,
    layout: SlotLayout,
    block_row: torch.Tensor,
    stop: int,
    dtype: torch.dtype,
    start: int = 0,
) -> tuple[Packed, Packed]:
    """Positions ``start:stop`` of one request, read through its block-table row, as packed K and V.

    Args:
        pages: the layer's page tensor.
        layout: its slot layout.
        block_row: ``[max_blocks]`` the request's block ids.
        stop, start: the positions to read.
        dtype: what decoding the result returns (the model's dtype).

    Returns:
        ``(packed_k, packed_v)``, fields ``[1, num_kv_heads, stop - start, ...]``.
    """
    _check_pages(pages, layout)
    block_size = pages.shape[1]
    if not 0 <= start <= stop or -(-stop // block_size) > block_row.shape[0]:
        raise ValueError(
            f"positions {start}:{stop} need {-(-stop // block_size)} blocks, the block-table row has "
            f"{block_row.shape[0]}"
        )
    used = block_row[: -(-stop // block_size)].to(device=pages.device, dtype=torch.long)
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= pages.shape[0]):
        bad = int(used.min()) if int(used.min()) < 0 else int(used.max())
        raise ValueError(
            f"the block-table row names block {bad} for positions 0:{stop}, but the pages hold blocks "
            f"0..{pages.shape[0] - 1}: a block table from another cache, or one vLLM did not fill; pass the layer's "
            "own pages and block table"
        )
    pos = torch.arange(start, stop, device=pages.device)
    blocks = used[pos // block_size]
    raw = pages[blocks, pos % block_size]  # [T, kv_heads, slot_bytes]
    return layout.from_bytes(raw.transpose(0, 1).unsqueeze(0), dtype)


def decode_paged(
    query: torch.Tensor,
    pages: torch.Tensor,
    layout: SlotLayout,
    k_codec: Codec,
    v_codec: Codec,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    scale: float,
    backend: str = "auto",
    sinks: SinkRows | None = None,
) -> torch.Tensor:
    """One decode step per request: ``query[r]`` attends over the ``seq_lens[r]`` tokens in its pages.

    All requests go through :func:`walshkv.attention.decode_attention_paged`: on the CPU one fused kernel call that
    follows the block table itself (no per-request loop, nothing gathered); on CUDA one Triton launch that does the
    same, with its checks as device-side asserts (nothing read back to the host); other codecs request by request.

    Args:
        query: ``[num_reqs, num_q_heads, head_dim]``, one token per request.
        pages, layout: the layer's page tensor and slot layout.
        k_codec, v_codec: the layer's bound codecs.
        block_table: ``[num_reqs, max_blocks]``.
        seq_lens: ``[num_reqs]`` tokens per request (the current one included).
        scale: softmax scale.
        backend: :func:`walshkv.attention.decode_attention`'s backend.
        sinks: the layer's ``sink:N:`` rows (then, and for a positional K codec, requests are read one by one).

    Returns:
        ``[num_reqs, num_q_heads, head_dim]`` in ``query``'s dtype.
    """
    _check_pages(pages, layout)
    lens = torch.as_tensor(seq_lens)
    if lens.dim() != 1 or lens.shape[0] != query.shape[0]:
        raise ValueError(f"{query.shape[0]} decode queries but {lens.numel()} sequence lengths")
    _check_requests(block_table, lens.tolist() if lens.device.type == "cpu" else [])
    if sinks is not None or is_positional(k_codec):
        out = torch.empty_like(query)
        for r, n in enumerate(lens.tolist()):
            if n < 1:
                raise ValueError(f"request {r} has no tokens to attend to (seq_lens {n})")
            head, pk, pv, start = _context(pages, layout, k_codec, block_table[r], n, query.dtype, sinks)
            o = decode_attention(
                query[r : r + 1].unsqueeze(2),
                pk,
                pv,
                k_codec,
                v_codec,
                scale=scale,
                window_k=None if head is None else head[0],
                window_v=None if head is None else head[1],
                backend=backend,  # type: ignore[arg-type]
                start=start,
            )
            out[r] = o[0, :, 0]
        return out
    pk, pv = layout.page_views(pages, query.dtype)
    out = decode_attention_paged(
        query.unsqueeze(2),
        pk,
        pv,
        k_codec,
        v_codec,
        block_table,
        lens,
        scale=scale,
        backend=backend,  # type: ignore[arg-type]
    )
    return out.squeeze(2)


def _k_offset(k_codec: Codec) -> torch.Tensor | None:
    """What decoding leaves subtracted from K (``center+``), ``[kv_heads, head_dim]``, else ``None`` (a positional
    codec decodes K in the model's basis, its mean added back)."""
    centered = None if is_positional(k_codec) else find_wrapper(k_codec, Centered)
    return None if centered is None else centered.plain_offset().to(torch.float32)


def _context(
    pages: torch.Tensor,
    layout: SlotLayout,
    k_codec: Codec,
    block_row: torch.Tensor,
    stop: int,
    dtype: torch.dtype,
    sinks: SinkRows | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, Packed | None, Packed | None, int]:
    """Positions ``0:stop`` of one request as attention reads them: ``(head, packed_k, packed_v, start)``.

    ``head``: the sink rows ``(K, V)`` ``[1, kv_heads, m, head_dim]`` float32 (K shifted like the decoded keys),
    or ``None``; the packed positions ``start:stop`` (``None`` when there are none), ``start = m``.
    """
    head = None
    m = 0 if sinks is None else min(sinks.n, stop)
    if m:
        hk, hv = sinks.head(pages, int(block_row[0]), m)  # type: ignore[union-attr]
        hk, hv = hk.to(torch.float32), hv.to(torch.float32)
        offset = _k_offset(k_codec)
        head = (hk if offset is None else hk - offset[None, :, None, :], hv)
    pk = pv = None
    if stop > m:
        pk, pv = read_sequence(pages, layout, block_row, stop, dtype, start=m)
    return head, pk, pv, m


def prefill_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pages: torch.Tensor,
    layout: SlotLayout,
    k_codec: Codec,
    v_codec: Codec,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor | list[int],
    seq_lens: torch.Tensor | list[int],
    scale: float,
    mode: str = "exact",
    sinks: SinkRows | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query chunk over its cached context and the chunk itself.

    Request ``r``'s queries are rows ``query_start_loc[r]:query_start_loc[r+1]``, at positions
    ``seq_lens[r] - q_len ... seq_lens[r] - 1``; the positions before them (an earlier chunk, a cached prefix) are
    read from the pages. The chunk's own K/V are ``key``/``value`` (``mode="exact"``) or read back from the pages,
    where :func:`write_slots` put them (``mode="quantized"``).

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the same rows.
        pages, layout, k_codec, v_codec, block_table: as for :func:`decode_paged`.
        query_start_loc: ``[num_reqs + 1]`` row offsets.
        seq_lens: ``[num_reqs]``.
        scale: softmax scale.
        mode: ``"exact"`` or ``"quantized"``.
        sinks: the layer's ``sink:N:`` rows (read before the packed positions, as :func:`decode_paged` reads them).

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in ``query``'s dtype (rows of no request left as zeros).
    """
    if mode not in ("exact", "quantized"):
        raise ValueError(f"prefill mode {mode!r}; choose 'exact' or 'quantized'")
    starts = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    if len(starts) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries for {len(lens)} requests (needs one more)")
    _check_requests(block_table, lens)
    if any(b < a for a, b in pairwise(starts)) or starts[0] < 0 or starts[-1] > query.shape[0]:
        raise ValueError(
            f"query_start_loc {starts} must rise from 0 to at most the {query.shape[0]} query rows; pass vLLM's own"
        )
    hq, hk = query.shape[1], layout.num_kv_heads
    if hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    offset = _k_offset(k_codec) if mode == "exact" else None
    general = sinks is not None or is_positional(k_codec)  # sink rows first, packed positions at their start
    out = torch.zeros_like(query)
    for r, n in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        q_len = b - a
        if q_len == 0:
            continue
        ctx = n - q_len
        if ctx < 0:
            raise ValueError(f"request {r} has {q_len} query tokens but a sequence of only {n}")
        cached = ctx if mode == "exact" else n
        pk = pv = window_k = window_v = head = None
        start = 0
        if general:
            if cached > 0:
                head, pk, pv, start = _context(pages, layout, k_codec, block_table[r], cached, query.dtype, sinks)
        elif cached > 0:
            pk, pv = read_sequence(pages, layout, block_table[r], cached, query.dtype)
        if mode == "exact":  # the chunk's own K/V in full precision, after the cached ones
            k_new, v_new = key[a:b].to(torch.float32), value[a:b].to(torch.float32)
            if sinks is not None and ctx < sinks.n:  # sink positions as they are kept (fp16), as CompressedCache
                held = min(sinks.n - ctx, q_len)
                k_new, v_new = k_new.clone(), v_new.clone()
                k_new[:held] = k_new[:held].to(torch.float16).to(torch.float32)
                v_new[:held] = v_new[:held].to(torch.float16).to(torch.float32)
            k_new = k_new if offset is None else k_new - offset.to(k_new.device)
            window_k = k_new.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, d]
            window_v = v_new.transpose(0, 1).unsqueeze(0)
        q = query[a:b].transpose(0, 1).unsqueeze(0)  # [1, q_heads, q_len, d]
        if general and (ctx > 0 or mode == "quantized"):  # sink rows, then packed tokens turned by position
            o = chunked_attention(
                q,
                pk,
                pv,
                k_codec,
                v_codec,
                offset=ctx,
                scale=scale,
                head_k=None if head is None else head[0],
                head_v=None if head is None else head[1],
                window_k=window_k,
                window_v=window_v,
                start=start,
            )
        elif ctx == 0:  # a whole prompt: one causal attention over it, which torch runs fused
            k_all = window_k if pk is None else k_codec.decode(pk).to(torch.float32)
            v_all = window_v if pv is None else v_codec.decode(pv).to(torch.float32)
            o = F.scaled_dot_product_attention(
                q.to(torch.float32), k_all, v_all, is_causal=True, scale=scale, enable_gqa=hq != hk
            )
        else:  # a later chunk: tiles of decoded keys, fused attention per tile, merged by log-sum-exp (no mask)
            o = chunked_attention(
                q, pk, pv, k_codec, v_codec, offset=ctx, scale=scale, window_k=window_k, window_v=window_v
            )
        out[a:b] = o[0].transpose(0, 1).to(query.dtype)
    return out
