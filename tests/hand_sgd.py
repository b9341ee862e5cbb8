"""The recipe of the tests that compare a run with SGD written by hand: plain SGD at lr 0.5 (no momentum, no
weight decay, a constant rate without warm-up), one epoch, quiet; as `fit`'s keywords."""


def plain_sgd(batch_size: int = 8) -> dict:
    return dict(
        epochs=1,
        batch_size=batch_size,
        lr=0.5,
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        schedule="constant",
        warmup_epochs=0,
        verbose=False,
    )
