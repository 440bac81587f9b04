"""Shared by the model tests (not collected): random adaLN weights and fixed tiny inputs."""
import torch


def randomize(model, seed=1):
    """adaLN-Zero makes every block the identity at init; random weights make the tests meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "final_layer" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def inputs(n=3, seed=2):
    """n digits-shaped inputs, timesteps spanning the schedule, labels including the null class."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.tensor([0, 10, 999][:n]), torch.tensor([1, 5, 10][:n])
