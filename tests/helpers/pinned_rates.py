"""Throughputs given to pre-inference instead of measured, so that what a test asserts about its plans (which
visits read a store, how each store is made) holds on any machine under any load.

A run with pre-inference plans with the throughputs it measures: one layer's forward (live, and inside a build), a
store's write and read speed and fixed cost, each block's step time. `pin_rates` makes every one of those
measurements give the value of the `Throughputs` passed; the code that measures still runs (the probe store is
written, read back and deleted), only its result is replaced. Each function takes the `setattr` to patch with: `monkeypatch.setattr` in a test,
the builtin in a child process."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pipelines.pre_inference.sweep_plan import Throughputs

Setattr = Callable[[object, str, object], None]

# One layer's forward over one 32-token sample of the tiny presets on a loaded machine, and a disk fast enough
# against it that a store rolled forward from a lower one costs less than one made from the input.
PINNED = Throughputs(layer_seconds=1e-3, write_bps=2e8, read_bps=1e9, store_overhead_s=0.02, build_layer_seconds=1e-3)


def pin_layer_forward(setattr_: Setattr, seconds: float) -> None:
    """The first estimate of one layer's forward over one sample (before any store measures it) is `seconds`."""
    from pipelines.pre_inference import probe

    setattr_(probe, "layer_seconds", lambda staged, batch: seconds)


def pin_rates(setattr_: Setattr, rates: Throughputs = PINNED) -> None:
    """Pre-inference's first estimates, its disk probe, and every store and visit it measures give `rates`."""
    from pipelines.pre_inference import probe
    from pipelines.pre_inference.rates import MeasuredRates

    def given(names: tuple[str, ...]) -> Callable[[Throughputs], Throughputs]:
        return lambda measured: dataclasses.replace(measured, **{name: getattr(rates, name) for name in names})

    def after(method: Callable, names: tuple[str, ...]) -> Callable:
        """`MeasuredRates.method`, after which the throughputs `names` are `rates`' (whatever it measured)."""
        def measured_then_given(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            self.current = given(names)(self.current)
            return result
        return measured_then_given

    measure_probe = probe.probe_store

    def probe_then_given(*args, **kwargs):
        measured, record = measure_probe(*args, **kwargs)
        return given(("build_layer_seconds", "write_bps", "read_bps", "store_overhead_s"))(measured), record

    pin_layer_forward(setattr_, rates.layer_seconds)
    setattr_(probe, "probe_store", probe_then_given)
    for name, measures in (("add_build", ("build_layer_seconds", "write_bps")), ("add_read", ("read_bps",)),
                           ("add_overhead", ("store_overhead_s",)), ("add_steps", ("step_seconds",))):
        setattr_(MeasuredRates, name, after(getattr(MeasuredRates, name), measures))
