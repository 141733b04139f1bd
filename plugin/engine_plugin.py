"""vLLM's general plugin entry point (`vllm.general_plugins` in pyproject.toml), loaded in every vLLM
process of an environment where specserve is installed, engine core included, before its executor
starts. It lets the step's draft tokens return with its sampled tokens (`plugin._vllm_internals`,
`carry_draft_token_ids_to_engine_core`); engines without `SpeculativeWorker` behave exactly as before.
"""

import logging

logger = logging.getLogger("specserve.engine_plugin")


def register() -> None:
    try:
        from plugin import _vllm_internals as internals

        internals.carry_draft_token_ids_to_engine_core()
    except Exception as exc:  # noqa: BLE001 - an untested vLLM must not stop engines that never use specserve
        logger.warning("specserve: draft tokens keep vLLM's own round trip (%s)", exc)
