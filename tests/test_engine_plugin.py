"""The engine plugin: drafts that ride back with a step's sampled tokens answer the engine core's
`take_draft_token_ids` without a round trip to the worker, and only for the step that carried them."""

import pickle
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput  # noqa: E402

from plugin import _vllm_internals as internals  # noqa: E402


class Executor:
    """Stands in for an executor whose calls would each be a message to the worker process."""

    def __init__(self, output):
        self.output, self.asked = output, 0

    def execute_model(self, scheduler_output, non_block=False):
        return None

    def sample_tokens(self, grammar_output, non_block=False):
        return self.output

    def take_draft_token_ids(self):
        self.asked += 1
        return "asked the worker"


class Runner:
    def __init__(self, drafts):
        self.drafts = drafts

    def take_draft_token_ids(self):
        return self.drafts


def carrying(drafts):
    return internals.attach_draft_token_ids(Runner(drafts), ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))


def patched_executor(output):
    cls = type("PatchedExecutor", (Executor,), {})
    internals._carry_drafts(cls)
    return cls(output)


def step(executor):
    executor.execute_model(None)
    executor.sample_tokens(None)
    return executor.take_draft_token_ids()


def test_drafts_on_the_output_answer_the_engine_core_without_asking_the_worker():
    drafts = DraftTokenIds(["a"], [[5, 6, 7]])
    executor = patched_executor(pickle.loads(pickle.dumps(carrying(drafts))))  # as it crosses processes
    assert step(executor) == drafts and executor.asked == 0
    assert step(patched_executor(carrying(None))) is None  # "no drafts" is an answer too


def test_a_step_whose_output_carried_no_drafts_still_asks_the_worker():
    executor = patched_executor(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))
    assert step(executor) == "asked the worker" and executor.asked == 1


def test_drafts_belong_to_the_step_that_returned_them():
    executor = patched_executor(carrying(DraftTokenIds(["a"], [[1]])))
    executor.execute_model(None)
    executor.sample_tokens(None)
    executor.execute_model(None)  # the next step began, and returned its output without sampling
    assert executor.take_draft_token_ids() == "asked the worker"
    step(executor)
    assert executor.take_draft_token_ids() == "asked the worker"  # taken once


def test_attaching_leaves_vllms_shared_empty_output_and_other_outputs_alone():
    runner = Runner(DraftTokenIds([], []))
    carried = internals.attach_draft_token_ids(runner, EMPTY_MODEL_RUNNER_OUTPUT)
    assert carried is not EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, internals.DRAFTS_ATTR)
    assert getattr(carried, internals.DRAFTS_ATTR) == runner.drafts
    assert internals.attach_draft_token_ids(runner, None) is None


def test_vllm_loads_the_plugin_and_it_patches_the_process_executors_once():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("specserve") == "plugin.engine_plugin:register"
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from plugin.engine_plugin import register

    register()
    take = MultiprocExecutor.take_draft_token_ids
    register()
    assert MultiprocExecutor._specserve_carries_drafts and MultiprocExecutor.take_draft_token_ids is take


def test_the_target_calibration_keeps_each_counts_least_time_over_interleaved_rounds():
    """Interleaved rounds and the least time per token count: extra work that lands on a few forwards
    (here in the runner itself) stays out of the curve."""
    import time
    from types import SimpleNamespace

    from plugin._vllm_internals import time_target_forwards

    def busy(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    class StandInRunner:
        device = SimpleNamespace(type="cpu")
        calls: list = []

        def _dummy_run(self, n):
            self.calls.append(n)
            busy(n * 0.002 + (0.03 if 5 <= len(self.calls) <= 10 else 0.0))  # rounds 1 and 2 of count 4, say

    runner = StandInRunner()
    # Five rounds, so that every count has three clean ones: on a loaded machine a stray hiccup of this
    # thread's own (the CI run caught one of 22 ms) can land on one of them.
    seconds = time_target_forwards(runner, (1, 2, 4), rounds=5)
    assert runner.calls == [1, 2, 4] * 6  # a warm-up round, then five, each count once per round
    assert all(n * 0.002 <= seconds[n] < n * 0.002 + 0.01 for n in (1, 2, 4)), seconds


def test_calibration_on_a_cpu_counts_this_threads_work_not_the_wall_clock():
    """Time spent off the CPU (here asleep; at start-up, preempted by another engine) is not counted."""
    import time

    import torch

    from plugin.step_profile import work_clock

    clock = work_clock(torch.device("cpu"))
    began = clock()
    time.sleep(0.2)
    assert clock() - began < 0.05
    assert work_clock(torch.device("cuda")) is time.perf_counter
