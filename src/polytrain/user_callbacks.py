"""The user's callback objects: each hook is called with the signature it declares, polytrain's, Keras' or
Lightning's, so that callbacks written for those libraries run unchanged.

- polytrain's: `on_epoch_end(self, trainer)`, for `on_fit_start`, `on_epoch_start`, `on_step_end`,
  `on_validation_end`, `on_epoch_end`, `on_fit_end`.
- Keras': `on_epoch_end(self, epoch, logs=None)` (a first parameter named `epoch` or `batch`, or a `logs`
  parameter): the epoch or the batch within it from 0, and a dict of figures by Keras' names (`loss`, `acc`
  and `accuracy`, `val_loss`, ...); `self.model.stop_training = True` stops training.
- Lightning's: `on_train_epoch_end(self, trainer, pl_module)`, with the trainer and the module.

A hook that fits none of its name's signatures, or a hook of those libraries that polytrain does not call, is
refused in one line before training.
"""

from __future__ import annotations

import inspect
import sys

import torch

from .callbacks import Callback
from .errors import UserError

POLYTRAIN = (
    "on_fit_start",
    "on_epoch_start",
    "on_step_end",
    "on_validation_end",
    "on_epoch_end",
    "on_fit_end",
)
# Keras' hooks and what their first argument is ("logs": they take the logs only)
KERAS = {
    "on_train_begin": "logs",
    "on_train_end": "logs",
    "on_epoch_begin": "epoch",
    "on_epoch_end": "epoch",
    "on_train_batch_begin": "batch",
    "on_train_batch_end": "batch",
    "on_batch_begin": "batch",
    "on_batch_end": "batch",
}
# Lightning's hooks and the arguments they take after (trainer, pl_module)
LIGHTNING = {
    "setup": ("stage",),
    "on_fit_start": (),
    "on_train_start": (),
    "on_train_epoch_start": (),
    "on_train_batch_start": ("batch", "batch_idx"),
    "on_train_batch_end": ("outputs", "batch", "batch_idx"),
    "on_validation_start": (),
    "on_validation_epoch_start": (),
    "on_validation_epoch_end": (),
    "on_validation_end": (),
    "on_train_epoch_end": (),
    "on_train_end": (),
    "on_fit_end": (),
    "teardown": ("stage",),
}
# hooks of those libraries that polytrain never calls: a callback that has one is refused, never ignored
NOT_CALLED = (
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_start",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
)
# the base classes' hooks do nothing: only those a user's class defines count
LIBRARIES = ("lightning.", "pytorch_lightning.", "keras.", "tensorflow.", "tf_keras.")


def own_hooks(item) -> list:
    """The hook names `item`'s class defines itself (not inherited from Lightning's or Keras' base classes)."""
    names = []
    for name in dict.fromkeys((*POLYTRAIN, *KERAS, *LIGHTNING, *NOT_CALLED)):
        if not callable(getattr(item, name, None)):
            continue
        owner = next((cls for cls in type(item).__mro__ if name in vars(cls)), None)
        if owner is None or not (owner.__module__ or "").startswith(LIBRARIES):
            names.append(name)
    return names


def binds(signature, *args) -> bool:
    try:
        signature.bind(*args)
        return True
    except TypeError:
        return False


def style_of(name: str, method):
    """How `method` (the hook `name`) is called: "polytrain", "keras", "lightning", or None (it fits none)."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # no signature to read (a builtin): polytrain's, and let the call say
        return "polytrain" if name in POLYTRAIN else None
    parameters = list(signature.parameters)
    keras = name in KERAS and ("logs" in parameters or parameters[:1] == [KERAS[name]])
    if keras:
        return "keras" if binds(signature, *([{}] if KERAS[name] == "logs" else [0, {}])) else None
    if name in POLYTRAIN and binds(signature, None):
        return "polytrain"
    if name in LIGHTNING and binds(signature, None, None, *LIGHTNING[name]):
        return "lightning"
    return None


def signatures(name: str) -> str:
    """The signatures polytrain calls the hook `name` with, for an error message."""
    forms = []
    if name in POLYTRAIN:
        forms.append(f"{name}(self, trainer) (polytrain)")
    if name in KERAS:
        first = "" if KERAS[name] == "logs" else f"{KERAS[name]}, "
        forms.append(f"{name}(self, {first}logs=None) (Keras)")
    if name in LIGHTNING:
        forms.append(f"{name}(self, {', '.join(('trainer', 'pl_module', *LIGHTNING[name]))}) (Lightning)")
    return " or ".join(forms)


def hook_plan(item) -> dict:
    """{hook name: style} of the hooks `item` defines; one line for a hook polytrain cannot call as written."""
    name = getattr(item, "__name__", type(item).__name__)
    plan = {}
    for hook in own_hooks(item):
        if hook in NOT_CALLED:
            raise UserError(
                f"callbacks=: {name}.{hook} is a hook polytrain does not call; remove it, or do its "
                f"work in a hook polytrain calls ({', '.join(POLYTRAIN)}; Keras' and Lightning's "
                f"epoch, batch and train hooks)"
            )
        style = style_of(hook, getattr(item, hook))
        if style is None:
            raise UserError(
                f"callbacks=: {name}.{hook} takes arguments polytrain cannot give; write it as "
                f"{signatures(hook)}"
            )
        plan[hook] = style
    return plan


def check_callbacks(callbacks) -> tuple:
    """`fit(callbacks=...)`: one object or a list of them, each with at least one hook it can be called with."""
    items = (
        ()
        if callbacks is None
        else tuple(callbacks)
        if isinstance(callbacks, (list, tuple))
        else (callbacks,)
    )
    for item in items:
        name = getattr(item, "__name__", type(item).__name__)
        if isinstance(item, type):
            raise UserError(f"callbacks= takes objects; got the class {name}: pass {name}()")
        if not hook_plan(item):
            raise UserError(
                f"callbacks=: {name} has none of the methods {', '.join(POLYTRAIN)} (or Keras' or "
                f"Lightning's hooks); name its methods so"
            )
    return items


def keras_logs(record: dict) -> dict:
    """An epoch's or validation's figures by Keras' names: loss, acc (and accuracy), val_loss, val_acc, ..."""
    logs = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = key[len("train_") :] if key.startswith("train_") else key if key.startswith("val_") else None
        if name is None:
            continue
        logs[name] = value
        if name.endswith("acc"):
            logs[name + "uracy"] = value  # Keras names metrics=["accuracy"] so
    if "lr" in record:
        logs["learning_rate"] = record["lr"]
    return logs


class UserCallbacks(Callback):
    """The user's callback objects, on the main rank: each hook called with the signature it declares."""

    def __init__(self, objects):
        self.objects = tuple(objects)
        self.plans = [hook_plan(item) for item in self.objects]
        self.last_logs = {}

    def _call(self, trainer, hooks, *, keras=(), lightning=(), only=None) -> None:
        """Each object's hooks among `hooks`, in that order, each with the arguments of its style."""
        for item, plan in zip(self.objects, self.plans):
            for hook in hooks:
                style = plan.get(hook)
                if style is None or only not in (None, style):
                    continue
                method = getattr(item, hook)
                if style == "polytrain":
                    method(trainer)
                elif style == "keras":
                    method(*keras)
                    if getattr(trainer.model, "stop_training", False):  # Keras' self.model.stop_training
                        trainer.should_stop = True
                else:
                    method(trainer, trainer.model, *lightning)

    def on_fit_start(self, trainer):
        for item, plan in zip(self.objects, self.plans):
            if "keras" in plan.values():  # Keras hands its callbacks the model and the run's parameters
                if callable(getattr(item, "set_model", None)):
                    item.set_model(trainer.model)
                elif not hasattr(item, "model"):
                    item.model = trainer.model
                if callable(getattr(item, "set_params", None)):
                    item.set_params(
                        {"epochs": trainer.epochs, "steps": trainer.steps_per_epoch, "verbose": 0}
                    )
        self._call(trainer, ("setup",), lightning=("fit",))
        self._call(trainer, ("on_fit_start", "on_train_start", "on_train_begin"), keras=({},))

    def on_epoch_start(self, trainer, epoch):
        self._call(trainer, ("on_epoch_start", "on_train_epoch_start", "on_epoch_begin"), keras=(epoch, {}))

    def on_step_start(self, trainer, step):
        self._call(
            trainer,
            ("on_train_batch_start", "on_train_batch_begin", "on_batch_begin"),
            keras=(step, {}),
            lightning=(trainer.batch.whole, step),
        )

    def on_step_end(self, trainer, step):
        wanted = {hook for plan in self.plans for hook in plan}
        keras = lightning = ()
        if wanted & {"on_train_batch_end", "on_batch_end"}:  # reads the device: only when asked
            loss_sum, loss_count, metric_sums, count, _ = trainer.running_totals()
            logs = {
                "loss": loss_sum / loss_count if loss_count else float("nan"),
                **{name: value / max(count, 1) for name, value in zip(trainer.metric_names, metric_sums)},
            }
            keras = (step, keras_logs({f"train_{key}": value for key, value in logs.items()}))
            lightning = ({"loss": torch.tensor(trainer.metrics["step_loss"])}, trainer.batch.whole, step)
        self._call(trainer, ("on_step_end",))
        self._call(trainer, ("on_train_batch_end",), keras=keras, lightning=lightning)
        self._call(trainer, ("on_batch_end",), keras=keras)

    def on_validation_start(self, trainer):
        self._call(trainer, ("on_validation_start", "on_validation_epoch_start"))

    def on_validation_end(self, trainer, record):
        self._call(trainer, ("on_validation_epoch_end", "on_validation_end"))

    def on_epoch_end(self, trainer, record):
        self.last_logs = keras_logs(record)
        self._call(
            trainer, ("on_epoch_end", "on_train_epoch_end"), keras=(record["epoch"] - 1, self.last_logs)
        )

    def on_fit_end(self, trainer):
        if sys.exc_info()[0] is not None:  # training failed: Keras and Lightning end no run then
            self._call(trainer, ("on_fit_end",), only="polytrain")
            return
        self._call(trainer, ("on_train_end", "on_fit_end"), keras=(self.last_logs,))
        self._call(trainer, ("teardown",), lightning=("fit",))
