"""The engine's admission gate, the DRAIN stage's engine side: refuses new requests at once, waits for
in-flight ones, gives up at its bound (still refusing), and serves again only after resume."""

from __future__ import annotations

import threading

from rlslurm.rollout.batcher import AdmissionGate


def test_drain_waits_for_in_flight_and_is_bounded():
    gate = AdmissionGate()
    assert gate.enter() and gate.enter()
    assert gate.drain(timeout_s=0.05) is False  # two still in flight: the bound holds
    assert gate.state == "draining" and not gate.enter()

    finished = threading.Event()

    def finish_later():
        finished.wait(5)
        gate.leave()
        gate.leave()

    worker = threading.Thread(target=finish_later)
    worker.start()
    finished.set()
    assert gate.drain(timeout_s=5) is True
    worker.join()
    assert gate.state == "drained" and gate.in_flight == 0 and not gate.enter()
    gate.resume()
    assert gate.enter() and gate.state == "serving"


def test_draining_an_idle_gate_is_immediate_and_idempotent():
    gate = AdmissionGate()
    assert gate.drain(timeout_s=0) and gate.drain(timeout_s=0)
    assert gate.state == "drained"
