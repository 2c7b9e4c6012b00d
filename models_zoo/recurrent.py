"""An LSTM sequence classifier.

``nn.LSTM`` is a torch.nn module, so torch.fx keeps it as one leaf call; passes see it as opaque.
"""

from __future__ import annotations

import torch
from torch import nn

from fxopt.models_zoo.entry import ZooEntry, float_inputs, zoo_entry

FEATURES = 16
SEQ_LEN = 12


class LstmClassifier(nn.Module):
    """Linear input projection, a 2-layer batch-first LSTM, the last time step, a Linear head."""

    def __init__(self, features: int = FEATURES, hidden: int = 36, num_classes: int = 5) -> None:
        super().__init__()
        self.input_proj = nn.Linear(features, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequence = self.lstm(torch.tanh(self.input_proj(x)))[0]
        return self.head(sequence[:, -1])


ENTRIES: tuple[ZooEntry, ...] = (
    zoo_entry("lstm_classifier", LstmClassifier, float_inputs(SEQ_LEN, FEATURES), default_batch=4,
              description="Linear projection, 2-layer LSTM (hidden 36), last step, Linear head; "
                          "input (B,12,16) -> (B,5)",
              tags=("rnn",)),
)
