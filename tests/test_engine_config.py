"""EngineConfig: every engine option is typed and checked once, with its name in the error; keywords
and a config object build the same engine."""
import pytest

from rollout_service import Engine
from rollout_service.engine.config import EngineConfig


def test_keywords_and_config_object_are_the_same_engine():
    by_config = Engine("tiny:qwen2", EngineConfig(window=4, group=2, max_num_seqs=8))
    by_keywords = Engine("tiny:qwen2", window=4, group=2, max_num_seqs=8)
    assert by_config.config == by_keywords.config
    assert (by_config.window, by_config.group, by_config.max_num_seqs) == (4, 2, 8)
    assert Engine("tiny:qwen2", by_config.config, window=8).config.window == 8  # keywords override


@pytest.mark.parametrize("options, error, name", [
    (dict(windw=4), TypeError, "windw"),
    (dict(window=0), ValueError, "window"),
    (dict(group=2.5), ValueError, "group"),
    (dict(kv_cache_tokens=True), ValueError, "kv_cache_tokens"),
    (dict(max_model_len=1), ValueError, "max_model_len"),
    (dict(verified_decode="fast"), ValueError, "verified_decode"),
    (dict(verified_decode="canonical"), ValueError, "verified_decode"),  # that is determinism="invariant"
    (dict(fast_path_options=[1]), TypeError, "fast_path_options"),
])
def test_bad_options_name_the_option(options, error, name):
    with pytest.raises(error, match=name):
        EngineConfig.build(**options)
    with pytest.raises(error, match=name):
        Engine("tiny:qwen2", **options)


def test_worker_options_split_into_a_checked_parallel_config():
    from rollout_service.engine.config import ParallelConfig, split_worker_options
    parallel, engine = split_worker_options({"tensor_parallel_size": 2, "backend": "native", "window": 4})
    assert parallel == ParallelConfig(2, "native") and engine == {"window": 4}
    assert split_worker_options(None) == (ParallelConfig(), {})
    for bad, error in (({"tensor_parallel_size": 0}, ValueError), ({"tensor_parallel_size": "2"}, ValueError),
                       ({"backend": "sglang"}, ValueError)):
        with pytest.raises(error):
            split_worker_options(bad)
