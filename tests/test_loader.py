import pytest
import torch
from conftest import tiny_digits

from polytrain.data import load_dataset
from polytrain.data.augment import crop_and_flip
from polytrain.data.loader import DeviceLoader, global_batch_order, make_loaders, rank_slice


def loader(data, *, batch_size=32, rank=0, world_size=1, seed=0, augment=False):
    mean, std = data.channel_stats()
    return DeviceLoader(
        data.train_x,
        data.train_y,
        batch_size=batch_size,
        mean=mean,
        std=std,
        device="cpu",
        rank=rank,
        world_size=world_size,
        seed=seed,
        augment=augment,
    )


def test_each_epoch_is_a_seeded_permutation_of_every_sample():
    order = global_batch_order(1000, epoch=3, seed=7)
    assert sorted(order.tolist()) == list(range(1000))
    assert torch.equal(order, global_batch_order(1000, epoch=3, seed=7))
    assert not torch.equal(order, global_batch_order(1000, epoch=4, seed=7))
    assert not torch.equal(order, global_batch_order(1000, epoch=3, seed=8))


def test_batches_cover_the_epoch_once_including_the_last_partial_batch(digits):
    one = loader(digits, batch_size=100)  # 256 samples: 100, 100, 56
    batches = list(one.train_batches(0))
    assert [len(b.y) for b in batches] == [100, 100, 56]
    assert [b.global_count for b in batches] == [100, 100, 56]
    seen = torch.cat([b.y for b in batches])
    order = global_batch_order(256, epoch=0, seed=0)
    assert torch.equal(seen, digits.train_y[order])


def test_ranks_split_every_global_batch_into_the_one_device_batch(digits):
    whole = list(loader(digits, batch_size=64).train_batches(1))
    parts = [list(loader(digits, batch_size=64, rank=r, world_size=3).train_batches(1)) for r in range(3)]
    for step, batch in enumerate(whole):
        joined_x = torch.cat([p[step].x for p in parts])
        joined_y = torch.cat([p[step].y for p in parts])
        assert torch.equal(joined_x, batch.x) and torch.equal(joined_y, batch.y)
        assert all(p[step].global_count == batch.global_count for p in parts)


def test_resume_from_a_step_gives_the_remaining_batches(digits):
    full = list(loader(digits).train_batches(2))
    rest = list(loader(digits).train_batches(2, start_step=3))
    assert [b.step for b in rest] == list(range(3, len(full)))
    assert all(torch.equal(a.x, b.x) for a, b in zip(full[3:], rest))


def test_normalisation_uses_training_mean_and_std(digits):
    mean, std = digits.channel_stats()
    pixels = digits.train_x.double() / 255
    assert torch.allclose(mean.double(), pixels.mean(), atol=1e-6)
    assert torch.allclose(std.double(), pixels.std(), atol=1e-6)
    batch = next(loader(digits, batch_size=256).train_batches(0))
    assert abs(batch.x.mean().item()) < 1e-4 and abs(batch.x.std().item() - 1) < 1e-3


def test_eval_shards_cover_the_split_exactly_once_without_padding():
    data = tiny_digits(n_train=50, n_val=101)
    for world in (1, 2, 3):
        labels = []
        for rank in range(world):
            _, val = make_loaders(
                data, batch_size=16, device="cpu", rank=rank, world_size=world, eval_batch_size=16
            )
            labels += [b.y for b in val.eval_batches()]
        assert torch.equal(torch.cat(labels), data.val_y)


def test_rank_slices_differ_by_at_most_one():
    sizes = [len(rank_slice(torch.arange(10), rank=r, world_size=4)) for r in range(4)]
    assert sorted(sizes) == [2, 2, 3, 3] and sum(sizes) == 10


def test_crop_and_flip_matches_a_per_image_reference():
    images = torch.randint(0, 255, (5, 3, 6, 6), dtype=torch.uint8)
    offsets = torch.tensor([[0, 0], [4, 4], [2, 3], [1, 0], [4, 2]])
    flips = torch.tensor([False, True, True, False, False])
    out = crop_and_flip(images, offsets, flips, pad=2)
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for i in range(5):
        top, left = offsets[i].tolist()
        expected = padded[i, :, top : top + 6, left : left + 6]
        if flips[i]:
            expected = expected.flip(-1)
        assert torch.equal(out[i], expected)


def test_augmentation_is_the_same_on_any_device_count(digits):
    whole = next(loader(digits, batch_size=64, augment=True).train_batches(0))
    parts = [
        next(loader(digits, batch_size=64, rank=r, world_size=2, augment=True).train_batches(0))
        for r in range(2)
    ]
    assert torch.equal(torch.cat([p.x for p in parts]), whole.x)
    plain = next(loader(digits, batch_size=64).train_batches(0))
    assert not torch.equal(plain.x, whole.x)


@pytest.mark.parametrize(
    "batch_size, world_size, accumulate, per_pass",
    [(8, 1, 1, 16), (8, 2, 1, 8), (8, 3, 1, 6), (8, 2, 2, 4), (256, 1, 1, 256), (512, 2, 1, 512)],
)
def test_validation_of_text_reads_a_few_training_passes_per_rank(
    batch_size, world_size, accumulate, per_pass
):
    """Validation keeps no activations for a backward pass, but its memory grows with the samples of a pass: by
    default it reads 2 training passes' samples of a rank (at most the larger of the batch and 256, as before),
    not 256 sequences per rank whatever the training pass (64 passes of a sharded Llama: twice training's
    peak)."""
    data = load_dataset("shakespeare", context=16)
    for rank in range(world_size):
        train, val = make_loaders(
            data, batch_size=batch_size, device="cpu", rank=rank, world_size=world_size, accumulate=accumulate
        )
        sizes = [len(batch.x) for batch in val.eval_batches()]
        largest = -(-val.num_samples // world_size)
        assert max(sizes) <= per_pass and len(sizes) == -(-largest // per_pass)
    _, val = make_loaders(data, batch_size=8, device="cpu", eval_batch_size=32)
    assert len(next(iter(val.eval_batches())).x) == 32  # as asked


@pytest.mark.parametrize(
    "num_samples, world_size, batch_size", [(9, 2, 2), (871, 4, 2), (5, 4, 3), (3, 4, 1)]
)
def test_every_rank_runs_as_many_validation_passes(num_samples, world_size, batch_size):
    """Ranks that gather weights together (FSDP2) must each run every forward pass: shards of 5 and 4 samples in
    batches of 2 are 3 passes on both (a rank with 2 passes left the other waiting for a gather)."""
    from polytrain.data.order import eval_parts

    parts = [
        eval_parts(num_samples, rank=r, world_size=world_size, batch_size=batch_size)
        for r in range(world_size)
    ]
    assert len({len(p) for p in parts}) == 1
    assert max(len(part) for p in parts for part in p) <= batch_size
    assert torch.cat([part for p in parts for part in p]).tolist() == list(range(num_samples))
