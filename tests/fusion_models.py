"""Model code for the fusion tests; cloudpickle sends it to Dask workers by value."""

from __future__ import annotations

import sys

import cloudpickle
import torch
from torch import nn
from torch.nn import functional as F

from cerebro_automl import TrainingSpec, accuracy
from cerebro_automl.training.plain import PlainTrainHooks

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def mlp(config):
    return nn.Sequential(nn.Linear(8, config.get("width", 16)), nn.ReLU(), nn.Dropout(config.get("dropout", 0.1)),
                         nn.Linear(config.get("width", 16), 3))


def bn_mlp(config):
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


class Branchy(nn.Module):
    """A forward that branches on a value its weights computed: vmap cannot batch it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else -self.b(h)


def branchy(config):
    return Branchy()


def sgd(config, params):
    return torch.optim.SGD(params, lr=config["lr"], momentum=config.get("momentum", 0.9),
                           weight_decay=config.get("weight_decay", 0.0))


def adam(config, params):
    return torch.optim.Adam(params, lr=config["lr"], betas=(config.get("beta1", 0.9), 0.999))


def adamw(config, params):
    return torch.optim.AdamW(params, lr=config["lr"], weight_decay=config.get("weight_decay", 0.01))


def halving(config, optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=config.get("gamma", 0.5))


def per_step_linear(config, optimizer):
    """A scheduler stepped after every optimizer step (Lightning's dict form)."""
    return {"scheduler": torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10),
            "interval": "step"}


def spec(model_fn=mlp, optimizer_fn=adam, **overrides) -> TrainingSpec:
    return TrainingSpec(**{"model_fn": model_fn, "optimizer_fn": optimizer_fn, "metrics": {"accuracy": accuracy},
                           "batch_size": 32, **overrides})


LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
CONFIGS = [{"lr": lr} for lr in LRS]


class OwnHooks(PlainTrainHooks):
    """The plain hooks under another class: a spec with hooks of its own, which trains unfused."""


class OwnHooksSpec(TrainingSpec):
    def train_hooks(self, config, *, state, progress, epoch, step):
        return OwnHooks(self, config)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, small: convolutions, BatchNorm, in-place ReLUs, a residual ``+=``."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class SmallResNet(nn.Module):
    """A ResNet in plain torch on 3x8x8 images: stem, two BasicBlocks (one downsampling), adaptive pool."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(2))
        self.blocks = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def small_resnet(config):
    return SmallResNet()


class SmallViT(nn.Module):
    """A timm-style ViT in plain torch on 3x8x8 images: patches of 4, a class token,
    one pre-norm block (attention of 2 heads through scaled_dot_product_attention, a GELU MLP)."""

    def __init__(self, dim: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.norm1, self.norm2, self.norm = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def attention(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 2, C // 2).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = x + self.attention(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(self.norm(x)[:, 0])


def small_vit(config):
    return SmallViT()
