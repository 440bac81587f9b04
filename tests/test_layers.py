"""The 2022 DiT block's layers (models/layers.py) are timm's, written out: built after the same seed
they hold the same parameters under the same names, and they compute the same outputs and
gradients, so checkpoints, the DiT release import and paired-seed runs are unchanged."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention as TimmAttention
from timm.models.vision_transformer import Mlp as TimmMlp
from timm.models.vision_transformer import PatchEmbed as TimmPatchEmbed

from ancre_dit.models.layers import Attention, Mlp, PatchEmbed


def _pair(ours, theirs, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    a = ours()
    torch.manual_seed(seed)
    b = theirs()
    return a.double(), b.double()


def _assert_same(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    torch.testing.assert_close(ya, yb, rtol=0, atol=1e-12)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=1e-12)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_is_timms(qk_norm):
    theirs = (partial(TimmAttention, 32, num_heads=4, qkv_bias=True, qk_norm=True, norm_layer=nn.RMSNorm) if qk_norm
              else partial(TimmAttention, 32, num_heads=4, qkv_bias=True))
    a, b = _pair(partial(Attention, 32, 4, qk_norm=qk_norm), theirs)
    if qk_norm:  # RMSNorm starts at ones: move it so that a swapped q / k norm would show
        for m in (a, b):
            torch.manual_seed(1)
            m.q_norm.weight.data.uniform_(0.5, 1.5)
            m.k_norm.weight.data.uniform_(0.5, 1.5)
    _assert_same(a, b, torch.randn(3, 10, 32, dtype=torch.float64))


def test_mlp_is_timms():
    a, b = _pair(partial(Mlp, 24, 96), partial(TimmMlp, in_features=24, hidden_features=96,
                                                 act_layer=partial(nn.GELU, approximate="tanh"), drop=0.0))
    _assert_same(a, b, torch.randn(3, 5, 24, dtype=torch.float64))


def test_patch_embed_is_timms():
    a, b = _pair(partial(PatchEmbed, 8, 2, 4, 32), partial(TimmPatchEmbed, img_size=8, patch_size=2, in_chans=4,
                                                           embed_dim=32, bias=True))
    assert (a.num_patches, a.grid_size, a.patch_size) == (b.num_patches, b.grid_size, b.patch_size)
    _assert_same(a, b, torch.randn(2, 4, 8, 8, dtype=torch.float64))
    tokens = a(torch.randn(2, 4, 8, 8, dtype=torch.float64))
    assert tokens.shape == (2, 16, 32) and tokens.stride() == b(torch.randn(2, 4, 8, 8, dtype=torch.float64)).stride()
