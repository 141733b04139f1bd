"""vLLM's general plugin entry point (`vllm.general_plugins` in pyproject.toml), loaded in every vLLM
process of an environment where specserve is installed, engine core included, before its executor
starts. It lets the step's draft tokens return with its sampled tokens (`plugin._vllm_internals`,
`carry_draft_token_ids_to_engine_core`), and requests that set min_p or logit_bias into engines whose
speculator is ours (`admit_min_p_and_logit_bias`); engines without `SpeculativeWorker` behave exactly as
before.
"""

import logging

from plugin.config import PROPOSER_CLASS

logger = logging.getLogger("specserve.engine_plugin")


def register() -> None:
    try:
        from plugin import _vllm_internals as internals
    except Exception as exc:  # noqa: BLE001 - an untested vLLM must not stop engines that never use specserve
        logger.warning("specserve: engine plugin not loaded (%s)", exc)
        return
    try:
        internals.carry_draft_token_ids_to_engine_core()
    except Exception as exc:  # noqa: BLE001
        logger.warning("specserve: draft tokens keep vLLM's own round trip (%s)", exc)
    try:
        internals.admit_min_p_and_logit_bias(PROPOSER_CLASS)
    except Exception as exc:  # noqa: BLE001
        logger.warning("specserve: requests with min_p or logit_bias stay refused by vLLM (%s)", exc)
