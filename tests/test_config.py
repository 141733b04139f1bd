"""Turning the speculator on: `speculative_engine_kwargs`, and the tooling's `engine_kwargs` on top of it."""

import json
import os

import pytest

from plugin.config import speculative_engine_kwargs
from specserve.engines import SPECULATIVE_OPTIONS, engine_kwargs


def test_engine_kwargs_hands_every_speculator_option_to_the_speculator():
    """Each keyword option of speculative_engine_kwargs given to engine_kwargs lands in the speculator's
    settings, never among vllm.LLM's own arguments (draft_dtype once went straight to vllm.LLM)."""
    assert SPECULATIVE_OPTIONS >= {"draft_dtype", "max_draft_rows", "max_draft_len", "fault_injection_rate"}
    kwargs = engine_kwargs(True, draft_dtype="bfloat16", max_draft_rows=8, max_draft_len=256,
                           fault_injection_rate=0.25, per_request_metrics="detailed", seed=3)
    options = kwargs["additional_config"]["specserve"]
    assert (options["draft_dtype"], options["max_draft_rows"], options["max_draft_len"],
            options["fault_injection_rate"]) == ("bfloat16", 8, 256, 0.25)
    assert kwargs["per_request_spec_decode_metrics"] == "detailed"
    assert not SPECULATIVE_OPTIONS & set(kwargs) and kwargs["seed"] == 3
    with pytest.raises(ValueError, match="plain engine"):
        engine_kwargs(False, draft_dtype="bfloat16")


def test_speculative_engine_kwargs_selects_the_plugin():
    kwargs = speculative_engine_kwargs("models/draft", 5)
    assert kwargs["speculative_config"] == {"method": "custom_class", "model": "plugin.proposer.DraftProposer",
                                            "num_speculative_tokens": 5}
    assert kwargs["worker_cls"] == "plugin.worker.SpeculativeWorker"
    with pytest.raises(ValueError, match="at least 1"):
        speculative_engine_kwargs("models/draft", 0)


def test_a_request_speed_floor_reaches_the_speculator_and_a_bad_one_is_refused():
    def floor(**kwargs):
        return speculative_engine_kwargs("models/draft", 4, **kwargs)["additional_config"]["specserve"]["request_speed_floor"]

    assert floor() == 0.8  # on by default
    assert floor(request_speed_floor=1.0) == 1.0
    assert floor(request_speed_floor=None) is None  # the step's goodput alone
    with pytest.raises(ValueError, match="request_speed_floor"):
        speculative_engine_kwargs("models/draft", 4, request_speed_floor=1.5)


@pytest.mark.parametrize("switch", ["compile_draft", "native_draft"])
def test_the_draft_switches_reach_the_speculator_and_a_bad_value_is_refused(switch):
    options = speculative_engine_kwargs("models/draft", 4, **{switch: "off"})["additional_config"]["specserve"]
    assert options[switch] == "off"
    with pytest.raises(ValueError, match=f"{switch} must be 'auto', 'on' or 'off', not 'yes'"):
        speculative_engine_kwargs("models/draft", 4, **{switch: "yes"})


def test_the_draft_cache_dtype_reaches_the_speculator_and_a_bad_value_is_refused():
    options = speculative_engine_kwargs("models/draft", 4, draft_cache_dtype="float32")["additional_config"]["specserve"]
    assert options["draft_cache_dtype"] == "float32"
    assert speculative_engine_kwargs("models/draft", 4)["additional_config"]["specserve"]["draft_cache_dtype"] == "auto"
    with pytest.raises(ValueError, match="draft_cache_dtype must be one of"):
        speculative_engine_kwargs("models/draft", 4, draft_cache_dtype="int8")


def test_the_embedded_default_runs_float32_where_the_cpu_would_emulate_bfloat16():
    """bfloat16 (the checkpoint's, "auto") where the CPU multiplies it natively, float32 where vLLM's kernels
    would emulate it (an AVX2-only AMD EPYC here: 58.7 against 191 tokens/s at batch 16), "auto" where
    /proc/cpuinfo says nothing; and the embedded default's engine settings carry this machine's answer."""
    from deployment.defaults import DEMO_ENGINE_KWARGS, cpu_model_dtype

    zen3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx f16c avx2 fma bmi2 vaes\n"
    sapphire_rapids = "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    skylake = "flags\t\t: fpu avx2 avx512f avx512bw avx512cd avx512dq\n"
    graviton3 = "processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16 svebf16\n"
    neoverse_n1 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
    assert cpu_model_dtype(zen3) == "float32" and cpu_model_dtype(skylake) == "float32"
    assert cpu_model_dtype(neoverse_n1) == "float32"
    assert cpu_model_dtype(sapphire_rapids) == "auto" and cpu_model_dtype(graviton3) == "auto"
    assert cpu_model_dtype("") == "auto"
    if "dtype" not in json.loads(os.environ.get("SPECSERVE_ENGINE_KWARGS") or "{}"):  # another machine's settings
        assert DEMO_ENGINE_KWARGS["dtype"] == cpu_model_dtype()


def test_on_few_cores_the_engine_worker_takes_them_all():
    """vLLM keeps one core per worker for its scheduler; on 3 CPUs or fewer the embedded default binds the
    worker to all of them (the 2 cores here: plain vLLM 176 -> 291-308 tokens/s at batch 16), on more it
    leaves vLLM's binding alone; the CPU engines' environment carries this machine's answer."""
    from deployment.defaults import CPU_ENGINE_ENV, cpu_worker_binding

    assert cpu_worker_binding({0, 1}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert cpu_worker_binding({5, 2, 3}) == {"VLLM_CPU_OMP_THREADS_BIND": "2,3,5"}  # the CPUs allowed, in order
    assert cpu_worker_binding(set(range(4))) == {} and cpu_worker_binding(set()) == {}
    assert CPU_ENGINE_ENV.items() >= cpu_worker_binding().items()
