"""fxopt.measure.advice: each lint fires on the pattern its seed tip describes, and only there."""

import torch
import torch.nn.functional as F
from torch import nn

from fxopt import models_zoo
from fxopt.capture.trace import trace
from fxopt.measure.advice import TIPS, run_lints


def _lints(model, x, **options):
    return run_lints(trace(model, x), x, **options)


def _by_code(lints):
    found = {}
    for lint in lints:
        found.setdefault(lint.code, []).append(lint.where)
    return found


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x = F.dropout(self.fc(x), 0.5)  # the bug: its default is to drop out in eval too
        return F.dropout(x, 0.5, training=self.training)  # correct


def test_mnist_net_large_linear_and_batch_size():
    model, (x,) = models_zoo.build("mnist_net", 4)
    lints = _lints(model, x)
    found = _by_code(lints)
    assert found == {"large-linear": ["fc1"], "not-multiple-of-8": ["batch size"]}
    linear = next(l for l in lints if l.code == "large-linear")
    assert "Linear(9216, 128)" in linear.message and "98%" in linear.message
    assert "O(nm)" in linear.tip and "PyTorch FAQ" in str(linear)


def test_odd_channel_cnn_batchnorm_and_channels_but_not_data_given_sizes():
    model, (x,) = models_zoo.build("odd_channel_cnn", 4)
    found = _by_code(_lints(model, x))
    assert found["batchnorm-small-batch"] == ["1", "4", "7"]
    assert found["not-multiple-of-8"] == ["0", "3", "6", "11", "batch size"]
    messages = {l.where: l.message for l in _lints(model, x) if l.code == "not-multiple-of-8"}
    assert "30 (out)" in messages["0"] and "3 (in)" not in messages["0"]  # RGB input is given
    assert "100 (in)" in messages["11"] and "10 (out)" not in messages["11"]  # 10 classes are given
    found_at_8 = _by_code(_lints(model, torch.randn(8, 3, 32, 32)))
    assert "batchnorm-small-batch" not in found_at_8 and "batch size" not in found_at_8[
        "not-multiple-of-8"]


def test_train_mode_for_inference():
    model, (x,) = models_zoo.build("mnist_net", 8)
    assert "train-mode-for-inference" not in _by_code(_lints(model, x))
    assert _by_code(_lints(model, x, for_inference=True))["train-mode-for-inference"] == [
        "dropout1", "dropout2"]
    model.eval()
    model.dropout2.train()  # switched back to train by mistake
    assert _by_code(_lints(model, x))["train-mode-for-inference"] == ["dropout2"]


def test_functional_dropout_without_training_flag():
    lints = [l for l in _lints(FunctionalDropout(), torch.randn(8, 16))
             if l.code == "functional-dropout-always-on"]
    assert len(lints) == 1
    assert "F.dropout(self.fc(x), 0.5)" in lints[0].message
    assert "training=self.training" in lints[0].hint


def test_clean_model_has_no_lints_and_every_lint_cites_its_source():
    clean = nn.Sequential(nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Flatten(), nn.Linear(16 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 8),
                          nn.Linear(8, 8))
    assert _lints(clean, torch.randn(8, 8, 8, 8)) == []
    # every tip names its public source by title, never by an internal label such as "seed 003"
    assert all(tip.count('"') >= 2 and "seed" not in tip for tip in TIPS.values())
