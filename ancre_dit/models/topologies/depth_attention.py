"""Routing across depth with attention, by hand (no library has it): DAR (timestep-adaptive, for DiTs)
and AttnRes (Kimi's attention residuals), in one trunk. v_0 is the embedding, v_l the gated output of
sublayer l = 1..2K (attention and MLP alternating, before any residual add); sublayer l (and a final
aggregator) reads h_l = sum_i alpha_{i->l} v_i over its sources S_l, per token

    alpha_{i->l} = softmax_i( q_l . RMSNorm_l(v_i) / s )       (s = sqrt(d) for DAR, 1 for AttnRes)

Zero queries and adaLN-Zero (v_l = 0) make h_l = v_0 / |S_l| at init: after LayerNorm, the plain DiT.
Queries: `static` (q_l = w_l), `static-t` (plus the timestep embedding through a zero-initialised head),
`dynamic` (q_l = W_l v_{l-1}, per token). Chunked DAR (chunk S): a chunk's summary is its last output;
block AttnRes (block S): the SUM of its outputs. Sublayer l sees the earlier summaries plus its own
group's outputs (partial sum) so far; S = 1 (block 0) is dense. The key norm is folded into the dot
product, (q * g) . v / rms(v), so no normalised copy of a source is kept for the backward.
"""
from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
import torch.nn as nn

from ...errors import UserError
from .base import ResidualTopology, TopologyNotDefined
from .registry import NonNegativeInt, PositiveInt, TopologyOption, register_topology

RMS_EPS = 1e-6


class DepthAttentionTopology(ResidualTopology):
    """DAR with `chunk` (keys scaled by 1/sqrt(d)), else AttnRes with `block` (no scaling)."""

    def __init__(self, num_blocks: int, hidden_size: int, query: str, chunk: int | None = None, block: int = 0):
        super().__init__(num_blocks)
        grouping, group = ("block", block) if chunk is None else ("chunk", chunk)
        layers = 2 * num_blocks
        if group and layers % group:  # the option's range is checked by the registry; this needs the depth
            raise UserError(f"{grouping} {group} does not divide the {layers} sublayers (2 per block); choose a "
                            f"divisor of {layers}" + (" or 0 for full AttnRes" if grouping == "block" else ""))
        self.hidden_size, self.query, self.grouping = hidden_size, query, grouping
        self.group = group or 1  # full AttnRes = blocks of one sublayer (sums of one output)
        self.scale = 1.0 / math.sqrt(hidden_size) if grouping == "chunk" else 1.0
        aggregators = layers + 1  # one per sublayer, plus the final one
        self.key_norms = nn.Parameter(torch.ones(aggregators, hidden_size))
        if query == "dynamic":
            self.query_maps = nn.Parameter(torch.zeros(aggregators, hidden_size, hidden_size))
        else:
            self.queries = nn.Parameter(torch.zeros(aggregators, hidden_size))
        if query == "static-t":
            self.time_head = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, hidden_size))
            nn.init.zeros_(self.time_head[1].weight)
            nn.init.zeros_(self.time_head[1].bias)
        self.takes_time_embedding = query == "static-t"
        self.record_weights = False  # True: keep each aggregator's mean weights (routing_weights())
        self._recorded: list[tuple[list[int], torch.Tensor]] = []

    def _reads(self, v: torch.Tensor, key_maps: torch.Tensor | None) -> torch.Tensor:
        """A new source's logits for every aggregator, (N, T, A) (static queries), or its RMS (N, T) (dynamic)."""
        rms = v.float().pow(2).mean(-1).add(RMS_EPS).sqrt().to(v.dtype)
        if key_maps is None:
            return rms
        maps = key_maps.to(v.dtype)
        keys = v @ maps.transpose(-1, -2) if maps.dim() == 2 else torch.einsum("ntd,nad->nta", v, maps)
        return keys / rms[..., None]

    def _aggregate(self, l: int, sources: list[tuple], previous: torch.Tensor) -> torch.Tensor:
        """h_l, the weighted sum of `sources` ((value, reads, sublayer id) triples) for aggregator l."""
        values = [v for v, _, _ in sources]
        self._source_ids.append([i for _, _, i in sources])
        if self.query == "dynamic":  # per token: q = W_l v_{l-1}, (N, T, d)
            q = torch.einsum("ntd,ed->nte", previous, self.query_maps[l]) * self.key_norms[l] * self.scale
            logits = [(v * q).sum(-1) / rms for v, rms, _ in sources]
        else:
            logits = [keys[..., l] for _, keys, _ in sources]
        alpha = torch.softmax(torch.stack(logits, dim=-1).float(), dim=-1).to(values[0].dtype)
        if self.record_weights:
            self._recorded.append(alpha.detach().float().mean(dim=(0, 1)))
        h = alpha[..., 0:1] * values[0]
        for i in range(1, len(values)):
            h = torch.addcmul(h, alpha[..., i:i + 1], values[i])
        return h

    def forward(self, h0: torch.Tensor, blocks: Sequence[nn.Module], c: torch.Tensor,
                time_embedding: torch.Tensor | None = None) -> torch.Tensor:
        self.check_blocks(blocks)
        # Static queries folded with their key norms and the scale: (A, d), or (N, A, d) with static-t.
        key_maps = None
        if self.query != "dynamic":
            q = self.queries if self.query == "static" else self.queries + self.time_head(time_embedding)[:, None, :]
            key_maps = q * self.key_norms * self.scale
        self._recorded, self._source_ids = [], []
        finished = [(h0, self._reads(h0, key_maps), 0)]  # the closed chunks' / blocks' summaries
        current: list[tuple] = []  # this chunk's outputs / this block's partial sum
        v = h0
        for k, block in enumerate(blocks):
            mod = block.modulation(c)
            for sub, (branch, modulation) in enumerate(((block.attention_branch, mod[:3]),
                                                        (block.mlp_branch, mod[3:]))):
                layer = 2 * k + sub + 1  # the sublayer whose output v is
                h = self._aggregate(layer - 1, finished + current, v)
                if sub == 0:  # the state fed to block k + 1
                    self.emit_state(k, h)
                v = self.run_block(branch, h, *modulation)
                if self.grouping == "block":  # a block's running partial sum is its one source until the block closes
                    source, current = (current[0][0] + v if current else v), []
                else:
                    source = v
                current.append((source, self._reads(source, key_maps), layer))
                last = layer == 2 * self.num_blocks and self.grouping == "chunk"  # DAR's final aggregator reads it raw
                if layer % self.group == 0 and not last:  # the group closes: its summary joins `finished`
                    finished.append(current[-1])
                    current = []
        h = self._aggregate(2 * len(blocks), finished + current, v)
        self.emit_state(len(blocks), h)
        return h

    def probabilities(self) -> torch.Tensor:
        raise TopologyNotDefined("depth attention weighs each source per token (and per timestep), so it has no "
                                 "fixed (K, K) matrix; see routing_weights() on a probe batch")

    def routing_weights(self) -> torch.Tensor:
        """(L+1, L+1) mean weights of the last forward with `record_weights` on: row l = the aggregator before
        sublayer l+1 (the last: the final one), column i = v_i (a summary under its last sublayer)."""
        if not self._recorded:
            raise UserError("no weights recorded: set record_weights = True and run a forward pass first")
        L = 2 * self.num_blocks
        W = torch.zeros(L + 1, L + 1)
        for row, (ids, alpha) in enumerate(zip(self._source_ids, self._recorded)):
            W[row, ids] = alpha.cpu()
        return W

    def extra_repr(self) -> str:
        name = "dar" if self.grouping == "chunk" else "attnres"
        return f"{name} query={self.query}, {self.grouping}={self.group}, sublayers={2 * self.num_blocks}"


QUERY = {"query": TopologyOption(Literal["static", "static-t", "dynamic"], "static", "the aggregators' queries: "
                                 "static (a learned vector), static-t (plus a zero-initialised head of the timestep "
                                 "embedding) or dynamic (a map of the previous output, per token)")}
# Their weights depend on the token and the timestep: no (K, K) matrix, mean weights per time instead.
DEPTH_ROUTING = {"matrix": False, "weights_per_time": True, "width": True}

register_topology("dar", **DEPTH_ROUTING,
                  options={**QUERY, "chunk": TopologyOption(PositiveInt, 4, "sublayers per chunk (1 = dense)")},
                  summary="DAR: softmax attention over earlier sublayer outputs (timestep-aware with static-t), "
                          "chunked")(DepthAttentionTopology)
register_topology("attnres", **DEPTH_ROUTING,
                  options={**QUERY, "block": TopologyOption(NonNegativeInt, 0, "sublayers per block (0 = full)")},
                  summary="AttnRes: attention residuals over earlier sublayer outputs, block sums with block S")(
    DepthAttentionTopology)
