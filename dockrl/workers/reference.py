"""Reference stage: claim responses, put their log-probs under the frozen initial policy.

Only started when ``algorithm.kl_coef > 0``.
"""

from __future__ import annotations

import time

from dockrl.dock import TransferDock
from dockrl.engines.train_protocol import TrainEngine


class ReferenceWorker:
    def __init__(self, engine: TrainEngine, *, temperature: float, micro_batch: int) -> None:
        self.engine, self.temperature, self.micro_batch = engine, temperature, micro_batch

    def run_iteration(self, dock: TransferDock) -> dict[str, float]:
        start = time.perf_counter()
        while claim := dock.claim("reference", ["prompt_ids", "response_ids"], self.micro_batch * 4):
            lps = self.engine.log_probs(
                claim.batch.column("prompt_ids").to_pylist(),
                claim.batch.column("response_ids").to_pylist(),
                temperature=self.temperature,
                micro_batch=self.micro_batch,
            )
            dock.put(claim.rows, {"ref_log_prob": lps}, ack=claim)
        return {"timing_s/reference": time.perf_counter() - start}
