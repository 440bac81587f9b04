"""Peer residual schemes from their papers' formulas (no library has them for a DiT): DenseFormer (arXiv
2402.02622), Hyper-Connections, static and dynamic (arXiv 2409.19606), mHC (arXiv 2512.24880). HC and mHC
wire the block's two branches themselves; their residual is n streams wide, so it has no (K, K) matrix.
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import reduce, repeat

from ...errors import UserError
from .base import ResidualTopology, TopologyNotDefined
from .registry import PositiveInt, TopologyOption, register_topology


def autocast_off(device: torch.device):
    """Autocast off (the meta device, where FLOPs are counted, has none to leave)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return nullcontext()


# mHC's paper fixes no initialisation; ours moves this much weight off HC's to the other streams, evenly.
# The mixing leak is larger: Sinkhorn-Knopp converges slowly near a permutation.
MHC_PRE_LEAK = 0.05
MHC_RES_LEAK = 0.25
# HC (dynamic): the paper initialises the tanh scales s_alpha, s_beta to 0.01 and W to 0.
HC_DYNAMIC_SCALE_INIT = 0.01


class DenseFormerTopology(ResidualTopology):
    """DenseFormer: a depth-weighted average (DWA) after every block.

        X_0 = h_0,   X_j = B_j(Y_{j-1}, c),   Y_j = sum_{i<=j} alpha_{j,i} X_i,   output Y_K

    alpha starts as the identity (the cascaded DiT). `alphas.{j-1}` holds block j's weights over X_0..X_j,
    the newest last: `probabilities()` gives P[j, i] = alpha_{j+1, i} (i <= j), `output_scales()` the rest.
    """

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.alphas = nn.ParameterList([nn.Parameter(F.one_hot(torch.tensor(j + 1), j + 2).float())
                                        for j in range(num_blocks)])

    def forward(self, h0, blocks, c):
        self.check_blocks(blocks)
        history, y = [h0], h0
        self.emit_state(0, y)
        for j, block in enumerate(blocks):
            history.append(self.run_block(block, y, c))
            alpha = self.alphas[j]
            y = history[-1] * alpha[-1]
            for i in range(j + 1):  # running sum, as ANCRe: no stacked history tensor
                y = torch.addcmul(y, history[i], alpha[i])
            self.emit_state(j + 1, y)
        return y

    def probabilities(self) -> torch.Tensor:
        K = self.num_blocks
        return torch.stack([F.pad(self.alphas[j][:-1], (0, K - 1 - j)) for j in range(K)])

    def output_scales(self) -> torch.Tensor:
        """(K,) weight of each block's own output in the average right after it (1 at init)."""
        return torch.stack([a[-1] for a in self.alphas])


class _StreamTopology(ResidualTopology):
    """HC's and mHC's trunk: n fp32 streams, started as copies of h_0, summed at the end. `_mix(l, H)` gives
    sublayer l's branch input, the mixed streams and the write weights; only the branch runs under autocast
    (bf16 would round every stream at every sublayer)."""

    streams: int

    def _wired_block(self, k: int, block: nn.Module, H: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Block k with its wiring: the attention (sublayer 2k), then the MLP branch (2k+1)."""
        mod = block.modulation(c)
        for l, branch, modulation in ((2 * k, block.attention_branch, mod[:3]), (2 * k + 1, block.mlp_branch, mod[3:])):
            with autocast_off(H.device):
                x, mixed, write = self._mix(l, H)
            out = branch(x, *modulation)
            with autocast_off(H.device):
                H = mixed + write.unsqueeze(-1) * out.to(mixed.dtype).unsqueeze(-2)
        return H

    def forward(self, h0, blocks, c):
        self.check_blocks(blocks)
        h0 = h0.float()
        H = repeat(h0, "... d -> ... n d", n=self.streams)  # n copies of h_0 (a view, no memory)
        self.emit_state(0, h0)
        for k, block in enumerate(blocks):  # a checkpointed unit = the block and its stream wiring
            H = self.run_block(partial(self._wired_block, k, block), H, c)
            if self.state_hook is not None:  # a block's output is the sum of the streams
                self.emit_state(k + 1, reduce(H, "... n d -> ... d", "sum"))
        return reduce(H, "... n d -> ... d", "sum")


class HyperConnectionTopology(_StreamTopology):
    """Hyper-Connections around both branches of every block. On n streams H (N, T, n, d), sublayer l
    (2K in all) with branch T_l computes

        x = A_m^T H                  width connection: the branch input, a mix of the streams
        H <- A_r^T H + B^T T_l(x)    stream mixing, and the depth connection writing the output

    with A_m (n,), A_r (n, n), B (n,) learned per sublayer (static HC). Dynamic HC adds, with H' =
    LayerNorm(H): B += s_beta tanh(H' W_beta)^T, A_m += s_alpha tanh(H' W_m), A_r += s_alpha tanh(H' W_r)
    (`dynamic_weights[l]` = [W_beta | W_m | W_r], `dynamic_scales[l]` = [s_alpha, s_beta]).
    Init (the paper's Pre-Norm-equivalent): A_m = e_{l mod n}, A_r = I, B = 1, W = 0, s = 0.01. Every
    stream is then the cascaded hidden state; the trunk returns n * h_K, which the final LayerNorm undoes.
    """

    def __init__(self, num_blocks: int, hidden_size: int, streams: int = 4, dynamic: bool = False):
        super().__init__(num_blocks)
        L, n = 2 * num_blocks, streams
        self.streams, self.dynamic = n, dynamic
        self.alpha_m = nn.Parameter(F.one_hot(torch.arange(L) % n, n).float())
        self.alpha_r = nn.Parameter(torch.eye(n).repeat(L, 1, 1))
        self.beta = nn.Parameter(torch.ones(L, n))
        if dynamic:
            self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
            self.dynamic_weights = nn.Parameter(torch.zeros(L, hidden_size, n + 2))
            self.dynamic_scales = nn.Parameter(torch.full((L, 2), HC_DYNAMIC_SCALE_INIT))

    def coefficients(self, l: int, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A_m, A_r, B) of sublayer l: (n,), (n, n), (n,) static; (N, T, n), (N, T, n, n), (N, T, n) dynamic."""
        a_m, a_r, b = self.alpha_m[l], self.alpha_r[l], self.beta[l]
        if self.dynamic:
            z = torch.tanh(self.norm(H) @ self.dynamic_weights[l])  # (N, T, n, n + 2)
            s_alpha, s_beta = self.dynamic_scales[l]
            b = s_beta * z[..., 0] + b
            a_m = s_alpha * z[..., 1] + a_m
            a_r = s_alpha * z[..., 2:] + a_r
        return a_m, a_r, b

    def _mix(self, l, H):
        a_m, a_r, b = self.coefficients(l, H)
        per = "..." if self.dynamic else ""  # dynamic coefficients are per token
        return torch.einsum(f"...sd,{per}s->...d", H, a_m), torch.einsum(f"...sd,{per}sr->...rd", H, a_r), b

    def probabilities(self) -> torch.Tensor:
        hint = "" if self.dynamic else " (topology.sublayer_weights() gives its effective sublayer weights)"
        raise TopologyNotDefined(f"{'hc-dynamic' if self.dynamic else 'hc'} mixes {self.streams} residual streams "
                                 f"around each sublayer{hint}, so it has no (K, K) block-to-block matrix")

    def sublayer_weights(self) -> torch.Tensor:
        """Static HC only: (2K, 2K+1), row l = sublayer l's input weights over [h_0, out_1, ..., out_2K]
        (out_m = gated output of sublayer m); the cascaded DiT (and this at init) is lower-triangular ones."""
        if self.dynamic:
            raise TopologyNotDefined("hc-dynamic's weights depend on the input; no fixed sublayer matrix")
        L, n = self.alpha_m.shape
        S = F.pad(torch.ones(n, 1, device=self.beta.device), (0, L))  # stream s = sum_src S[s, src] source
        rows = []
        for l in range(L):
            rows.append(self.alpha_m[l] @ S)
            S = self.alpha_r[l].T @ S + torch.outer(self.beta[l], F.one_hot(torch.tensor(l + 1), L + 1).to(S))
        return torch.stack(rows)

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, streams={self.streams}, dynamic={self.dynamic}"


def sinkhorn_knopp(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Doubly stochastic projection of exp(logits) over the last two dims: rows then columns `iters` times
    (the columns sum to 1 exactly, the rows only come close: the gap mHC-lite, arXiv 2601.05732, notes)."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))  # SK ignores a global scale
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


class ManifoldHyperConnectionTopology(_StreamTopology):
    """mHC: hyper-connections with a doubly stochastic stream mixing. Sublayer l, streams x (N, T, n, d):

        x~     = RMSNorm(vec(x))                               (1, n d), no weight
        H_pre  = sigmoid(a_pre  * x~ phi_pre  + b_pre)          (n,)    branch input weights
        H_post = 2 sigmoid(a_post * x~ phi_post + b_post)       (n,)    output write weights
        H_res  = SinkhornKnopp(a_res * mat(x~ phi_res) + b_res) (n, n)  stream mixing
        x     <- H_res x + H_post^T F(H_pre x)

    (`phi[l]` = [phi_pre | phi_post | phi_res], (n d, 2n + n^2); `alpha[l]` = [a_pre, a_post, a_res]).
    Init (ours): phi = 0, alpha = 0.01, H_post = 1, H_pre = 1 - p on stream l mod n and p / (n - 1)
    elsewhere, H_res = (1 - r) I + r / (n - 1) (1 1^T - I) (p, r = MHC_PRE_LEAK, MHC_RES_LEAK). The
    streams equal the cascaded hidden state, as in HC; favouring stream l mod n lets them diverge.
    """

    def __init__(self, num_blocks: int, hidden_size: int, streams: int = 4, sinkhorn_iters: int = 20):
        super().__init__(num_blocks)
        L, n = 2 * num_blocks, streams
        self.streams, self.sinkhorn_iters = n, sinkhorn_iters
        self.phi = nn.Parameter(torch.zeros(L, n * hidden_size, 2 * n + n * n))
        self.alpha = nn.Parameter(torch.full((L, 3), 0.01))
        pre = torch.full((L, n), MHC_PRE_LEAK / (n - 1))
        pre[torch.arange(L), torch.arange(L) % n] = 1.0 - MHC_PRE_LEAK
        self.bias_pre = nn.Parameter(torch.logit(pre, eps=0.0))
        self.bias_post = nn.Parameter(torch.zeros(L, n))
        res = torch.full((n, n), MHC_RES_LEAK / (n - 1)).fill_diagonal_(1.0 - MHC_RES_LEAK)
        self.bias_res = nn.Parameter(res.log().repeat(L, 1, 1))

    def coefficients(self, l: int, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (H_pre (..., n), H_post (..., n), H_res (..., n, n)) of sublayer l for streams H (..., n, d)."""
        n = self.streams
        with autocast_off(H.device):
            x = F.rms_norm(H.float().flatten(-2), (H.shape[-2] * H.shape[-1],), eps=1e-6)
            z = x @ self.phi[l].float()
            a_pre, a_post, a_res = self.alpha[l].float()
            pre = torch.sigmoid(a_pre * z[..., :n] + self.bias_pre[l].float())
            post = 2.0 * torch.sigmoid(a_post * z[..., n:2 * n] + self.bias_post[l].float())
            res_logits = a_res * z[..., 2 * n:].unflatten(-1, (n, n)) + self.bias_res[l].float()
            res = sinkhorn_knopp(res_logits, self.sinkhorn_iters)
        return pre, post, res

    def _mix(self, l, H):
        pre, post, res = self.coefficients(l, H)
        return torch.einsum("...s,...sd->...d", pre, H), torch.einsum("...rs,...sd->...rd", res, H), post

    def probabilities(self) -> torch.Tensor:
        raise TopologyNotDefined(f"mhc mixes {self.streams} residual streams with input-dependent doubly stochastic "
                                 f"matrices around each sublayer, so it has no (K, K) block-to-block matrix")

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, streams={self.streams}, sinkhorn_iters={self.sinkhorn_iters}"


STREAMS = {"hc_streams": TopologyOption(PositiveInt, 4, "residual streams n of hc / hc-dynamic / mhc")}

register_topology("denseformer", summary="DenseFormer: weighted average of the embedding and all block outputs")(
    lambda num_blocks, hidden_size: DenseFormerTopology(num_blocks))
register_topology("hc", options=STREAMS, matrix=False, width=True, summary="Hyper-Connections, static")(
    lambda num_blocks, hidden_size, hc_streams: HyperConnectionTopology(num_blocks, hidden_size, hc_streams))
register_topology("hc-dynamic", options=STREAMS, matrix=False, width=True,
                  summary="Hyper-Connections, input-dependent")(
    lambda num_blocks, hidden_size, hc_streams: HyperConnectionTopology(num_blocks, hidden_size, hc_streams, True))


def check_mhc(options: dict) -> None:
    if options["hc_streams"] < 2:
        raise UserError(f"mhc needs hc_streams >= 2 (a 1-stream doubly stochastic mix is the identity), "
                        f"got {options['hc_streams']}")


ITERS = {"sinkhorn_iters": TopologyOption(PositiveInt, 20, "Sinkhorn-Knopp iterations of mhc")}
register_topology("mhc", options={**STREAMS, **ITERS}, check=check_mhc, matrix=False, width=True,
                  summary="mHC: HC with a doubly stochastic (Sinkhorn-Knopp) stream mixing")(
    lambda num_blocks, hidden_size, hc_streams, sinkhorn_iters: ManifoldHyperConnectionTopology(
        num_blocks, hidden_size, hc_streams, sinkhorn_iters))
