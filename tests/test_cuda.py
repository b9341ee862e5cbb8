"""The CUDA and NCCL paths; skipped on machines without a GPU (CI), run by hand on one."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_digits

import polytrain
from polytrain.data.loader import make_loaders
from polytrain.models import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fit_on_cuda_matches_a_hand_written_cuda_loop(monkeypatch):
    # TF32 convolutions round differently for different memory layouts; compare in full fp32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    data = tiny_digits(n_train=192)
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, 10)
    reference = copy.deepcopy(model).cuda()
    train, _ = make_loaders(data, batch_size=32, device="cuda")
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for batch in train.train_batches(0):
        loss = F.cross_entropy(reference(batch.x.contiguous()), batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    polytrain.fit(
        model,
        data,
        epochs=1,
        batch_size=32,
        lr=0.05,
        momentum=0.9,
        weight_decay=0.0,
        schedule="constant",
        warmup_epochs=0,
        device="cuda",
        verbose=False,
    )
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs.cpu(), atol=1e-4, rtol=1e-4)  # cuDNN picks its own kernels


@pytest.mark.parametrize("settings", [dict(precision="bf16"), dict(compile=True), dict(strategy="data")])
def test_cuda_variants_train(settings):
    history = polytrain.fit(
        "lenet", tiny_digits(n_train=512), epochs=3, batch_size=64, device="cuda", verbose=False, **settings
    )
    assert history.last["val_acc"] > 0.9
