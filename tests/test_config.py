import pytest

from codesign.errors import ConfigError
from codesign.config.loader import DEFAULT_CONFIG, RaySettings, load_config
from codesign.config.types import AUTO_SEARCH
from tests.conftest import SHARED_FIXTURES, USER_CONFIGS
from tests.conftest import SMALL_CONFIG as BASE


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_user_fixtures_load_unchanged(fixture_config):
    config = load_config(fixture_config)
    assert config.training.avg_batch_size_per_device == 1024 and config.training.num_iters == 20
    assert [c.num_devices for c in config.clusters] == [1, 8, 16, 64]
    assert all(c.platform == "gpu" for c in config.clusters)
    assert sum(p.is_auto for p in config.parallels) == 2
    placed = [p for p in config.parallels if p.host_ids]
    assert placed[0].device_ids[1] == ((1, 3), (1, 3))
    assert config.parallels[2].sharding_options == {"force_batch_dim_to_mesh_dim": 0}
    uniform = load_config(fixture_config.with_name("uniform_model.toml"))
    assert len(uniform.models) == 37
    assert uniform.models[1].tokens == (("DOT",) * 4, ("DOT",) * 6, ("DOT",) * 2)
    assert uniform.models[0].tokens == (("ATTENTION", "LINEAR", "ATTENTION", "DOT"),) * 4


@pytest.mark.parametrize("name", ["config.toml", "uniform_model.toml"])
def test_the_users_configs_in_tests_data_are_the_shared_fixtures(name):
    """tests/data keeps the users' configs so the suite is self-contained; where the shared
    fixtures are beside the checkout, the copies must be theirs, byte for byte."""
    if not (SHARED_FIXTURES / name).exists():
        pytest.skip(f"the shared fixtures are not beside this checkout ({SHARED_FIXTURES} is absent)")
    assert (USER_CONFIGS / name).read_bytes() == (SHARED_FIXTURES / name).read_bytes()


def test_default_config_runs_anywhere():
    config = load_config(DEFAULT_CONFIG)
    assert {c.platform for c in config.clusters} == {"auto"}
    assert sorted(c.num_devices for c in config.clusters) == [1, 2, 4]
    mixers = {m for model in config.models for layer in model.tokens for m in layer}
    assert mixers == {"DOT", "LINEAR", "ATTENTION", "CONVOLUTION"}
    assert not any(p.is_auto for p in config.parallels)


def test_platform_and_new_keys(tmp_path):
    text = BASE.replace("num_iters = 3", 'num_iters = 3\nprecision = "bf16"\nlearning_rate = 0.01\nfold_dot = true')
    config = load_config(write(tmp_path, text))
    assert config.clusters[0].platform == "cpu"
    assert config.training.precision == "bf16" and config.training.learning_rate == 0.01
    assert config.training.fold_dot and not load_config(write(tmp_path, BASE)).training.fold_dot
    timed = load_config(write(tmp_path, BASE.replace("num_iters = 3", "num_iters = 3\nmin_measured_seconds = 1.5")))
    assert timed.training.min_measured_seconds == 1.5 and config.training.min_measured_seconds == 0


@pytest.mark.parametrize("old, new, table, field", [
    ('transport = "NVLink"', 'transport = "Carrier pigeon"', "[[cluster_spec]] #1", "transport"),
    ('platform = "cpu"', 'platform = "tpu"', "[[cluster_spec]] #1", "platform"),
    ('num_hosts = 1', 'num_hosts = 2', "[[cluster_spec]] #1", "transport"),
    ('tokens = ["LINEAR", "DOT"]', 'tokens = ["DOT", "MLP"]', "[[model]] #1", "tokens"),
    ('tokens = ["LINEAR", "DOT"]', 'tokens = [["DOT"], ["DOT"]]', "[[model]] #1", "tokens"),
    ('emb_dim = 4', 'emb_dim = 0', "[[model]] #1", "emb_dim"),
    ('num_iters = 3', 'num_iters = "3"', "[training_spec]", "num_iters"),
    ('num_iters = 3', 'num_iters = 3\nfold_dot = "yes"', "[training_spec]", "fold_dot"),
    ('num_iters = 3', 'num_iters = 3\nmin_measured_seconds = -1', "[training_spec]", "min_measured_seconds"),
    ('"(pp, dp, op)" = [1, 2, 1]', '"(pp, dp, op)" = [1, 2]', "[[parallel_spec]] #1", "(pp, dp, op)"),
    ('"(pp, dp, op)" = [1, 2, 1]', '', "[[parallel_spec]] #1", "(pp, dp, op)"),
    ('num_micro_batches = [1, 3]', 'num_micro_batches = [1, 3]\nphysical_mesh_shape = [1, 4]',
     "[[parallel_spec]] #1", "physical_mesh_shape"),
    ('num_micro_batches = [1, 3]', 'num_micro_batches = [1, 3]\nauto_sharding_option = { fast = true }',
     "[[parallel_spec]] #1", "auto_sharding_option"),
    ('num_micro_batches = [1, 3]', 'num_micro_batches = [1, 3]\nremat = true', "[[parallel_spec]] #1", "remat"),
])
def test_config_errors_name_file_table_and_field(tmp_path, old, new, table, field):
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (err.value.table, err.value.field) == (table, field)
    assert str(path) in str(err.value) and table in str(err.value)


@pytest.mark.parametrize("spelt, canonical", [("gpipe", "GPipe"), ("GPIPE", "GPipe"), ("1f1b", "1F1B"),
                                              ("GPipe", "GPipe")])
def test_alpa_schedule_spellings_load_as_the_canonical_name(tmp_path, spelt, canonical):
    text = BASE.replace('"(pp, dp, op)" = [1, 2, 1]', f'"(pp, dp, op)" = [2, 1, 1]\npipeline_schedule = "{spelt}"')
    same = BASE.replace('"(pp, dp, op)" = [1, 2, 1]', f'"(pp, dp, op)" = [2, 1, 1]\npipeline_schedule = "{canonical}"')
    assert load_config(write(tmp_path, text)) == load_config(write(tmp_path, same))
    assert load_config(write(tmp_path, text)).parallels[0].pipeline_schedule == canonical


def test_an_unknown_schedule_keeps_the_clear_error(tmp_path):
    text = BASE.replace('"(pp, dp, op)" = [1, 2, 1]', '"(pp, dp, op)" = [2, 1, 1]\npipeline_schedule = "zigzag"')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert (err.value.table, err.value.field) == ("[[parallel_spec]] #1", "pipeline_schedule")
    assert "expected one of ['1F1B', 'GPipe'], got 'zigzag'" in str(err.value)


def test_placement_must_match_stages(tmp_path):
    text = BASE.replace('"(pp, dp, op)" = [1, 2, 1]', '"(pp, dp, op)" = [2, 1, 1]\n'
                        'host_ids = [[0], [0]]\ndevice_ids = [[[0]], [[1, 2]]]')
    with pytest.raises(ConfigError, match="stage 1 holds 2 devices"):
        load_config(write(tmp_path, text))


def test_auto_search_needs_no_mesh(tmp_path):
    text = BASE.replace('description = "data parallel"', f'description = "{AUTO_SEARCH}"')
    text = text.replace('"(pp, dp, op)" = [1, 2, 1]\n', "")
    assert load_config(write(tmp_path, text)).parallels[0].is_auto


def test_auto_trials_is_an_optional_key_of_auto_search(tmp_path):
    auto = BASE.replace('description = "data parallel"', f'description = "{AUTO_SEARCH}"')
    assert load_config(write(tmp_path, auto)).parallels[0].auto_trials == 1
    three = auto.replace("num_micro_batches = [1, 3]", "num_micro_batches = [1, 3]\nauto_trials = 3")
    assert load_config(write(tmp_path, three)).parallels[0].auto_trials == 3
    for text, problem in ((three.replace("auto_trials = 3", "auto_trials = 0"), "expected an integer >= 1"),
                          (three.replace(f'"{AUTO_SEARCH}"', '"data parallel"'), "applies only to description")):
        with pytest.raises(ConfigError, match=problem) as err:
            load_config(write(tmp_path, text))
        assert (err.value.table, err.value.field) == ("[[parallel_spec]] #1", "auto_trials")
        assert str(tmp_path / "c.toml") in str(err.value)


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[training_spec\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")


def test_ray_table_is_optional(tmp_path):
    assert load_config(write(tmp_path, BASE)).ray == RaySettings()
    config = load_config(write(tmp_path, BASE + '\n[ray]\naddress = "10.0.0.1:6379"\nmax_concurrent = 3\n'))
    assert config.ray == RaySettings("10.0.0.1:6379", 3)


@pytest.mark.parametrize("table, field", [
    ('[ray]\naddress = 6379', "address"),
    ('[ray]\naddress = ""', "address"),
    ('[ray]\nmax_concurrent = 0', "max_concurrent"),
    ('[ray]\nworkers = 2', "workers"),
])
def test_ray_table_errors_name_the_field(tmp_path, table, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE + "\n" + table + "\n"))
    assert (err.value.table, err.value.field) == ("[ray]", field)


def test_gpu_config_holds_the_seed_model_on_one_and_eight_gpus():
    from codesign.zhen import counts

    config = load_config(DEFAULT_CONFIG.parent / "zhen_gpu.toml")
    (model,) = config.models
    assert counts.param_count(model) == 156_790_400
    assert config.training.avg_batch_size_per_device == 1024 and config.training.num_iters == 20
    assert [(c.num_devices, c.platform) for c in config.clusters] == [(1, "gpu"), (8, "gpu")]
