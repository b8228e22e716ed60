"""Config dataclasses and the file / env / CLI layering (polyspec.config)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polyspec.config import (
    BatchTree,
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
    cli_keys,
    load_config,
    parse_batch_trees,
)
from polyspec.errors import ConfigError, PolyspecError


@pytest.fixture(autouse=True)
def _no_polyspec_toml_in_cwd(tmp_path, monkeypatch):
    """load_config reads ./polyspec.toml: run every test in an empty folder."""
    monkeypatch.chdir(tmp_path)


# -- SpeculativeConfig ---------------------------------------------------------------------


def test_chain_default_num_draft_tokens_is_num_steps_plus_one():
    spec = SpeculativeConfig(algorithm="eagle", num_steps=5)
    assert spec.num_draft_tokens == 6 and spec.is_chain


@pytest.mark.parametrize(
    ("steps", "topk", "expected"), [(1, 2, 3), (1, 4, 5), (3, 2, 8), (2, 8, 8)]
)
def test_tree_default_num_draft_tokens(steps, topk, expected):
    assert SpeculativeConfig("eagle3", num_steps=steps, topk=topk).num_draft_tokens == expected


@given(
    steps=st.integers(1, 8),
    topk=st.integers(1, 8),
    n=st.one_of(st.none(), st.integers(-2, 600)),
)
def test_speculative_validation_accepts_exactly_the_valid_trees(steps, topk, n):
    max_nodes = topk + (steps - 1) * topk**2 + 1
    if n is None:
        valid = True
    elif topk == 1:
        valid = n == steps + 1
    else:
        valid = 2 <= n <= max_nodes
    if valid:
        spec = SpeculativeConfig("eagle", num_steps=steps, topk=topk, num_draft_tokens=n)
        assert isinstance(spec.num_draft_tokens, int)
        assert 2 <= spec.num_draft_tokens <= max_nodes
    else:
        with pytest.raises(ConfigError, match="speculative.num_draft_tokens"):
            SpeculativeConfig("eagle", num_steps=steps, topk=topk, num_draft_tokens=n)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "medusa"}, r"speculative.algorithm = 'medusa'.*'eagle', 'eagle3'"),
        ({"algorithm": "eagle", "num_steps": 0}, r"num_steps = 0 .*from 1 to 8"),
        ({"algorithm": "eagle", "num_steps": 9}, r"num_steps = 9 .*from 1 to 8"),
        ({"algorithm": "eagle", "topk": 9}, r"topk = 9 .*from 1 to 8"),
        ({"algorithm": "eagle", "topk": True}, r"topk = True"),
        ({"algorithm": "eagle", "num_steps": 3, "num_draft_tokens": 6}, r"chain.*= 4"),
        ({"algorithm": "eagle", "num_steps": 2, "topk": 2, "num_draft_tokens": 8}, r"from 2 to 7"),
    ],
)
def test_speculative_errors_name_key_value_and_allowed(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig(**kwargs)


def test_configs_are_frozen():
    spec = SpeculativeConfig("eagle")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.topk = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().page_size = 4  # type: ignore[misc]


# -- SamplingParams ------------------------------------------------------------------------


def test_sampling_normalises_stop_and_numbers():
    params = SamplingParams(stop="###", stop_token_ids=[2, 3], temperature=1, top_p=1)
    assert params.stop == ("###",) and params.stop_token_ids == (2, 3)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().greedy and not params.greedy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, r"sampling.max_new_tokens = 0 .*>= 1"),
        ({"temperature": -0.5}, r"sampling.temperature = -0.5"),
        ({"temperature": float("nan")}, r"sampling.temperature"),
        ({"top_k": -1}, r"sampling.top_k = -1 .*>= 0"),
        ({"top_p": 0.0}, r"sampling.top_p = 0.0 .*\(0, 1\]"),
        ({"top_p": 1.5}, r"sampling.top_p"),
        ({"stop": ["ok", ""]}, r"sampling.stop"),
        ({"stop_token_ids": [1, -2]}, r"sampling.stop_token_ids"),
        ({"ignore_eos": "yes"}, r"sampling.ignore_eos"),
        ({"seed": -1}, r"sampling.seed"),
    ],
)
def test_sampling_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


# -- EngineConfig --------------------------------------------------------------------------


def test_engine_defaults():
    cfg = EngineConfig()
    assert (cfg.dtype, cfg.page_size, cfg.max_batch_size, cfg.max_context) == ("auto", 1, 8, 4096)
    assert cfg.speculative is None and cfg.backend is None and cfg.num_kv_slots is None
    assert (cfg.max_tokens_per_step, cfg.prefill_chunk_size, cfg.seed) == (2048, 512, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "fp8"}, r"dtype = 'fp8' .*'auto', 'float32', 'bfloat16', 'float16'"),
        ({"page_size": 0}, r"page_size = 0"),
        ({"num_kv_slots": 100, "page_size": 16}, r"multiple of page_size = 16"),
        ({"prefill_chunk_size": 4096}, r"prefill_chunk_size = 4096 .*from 1 to 2048"),
        ({"draft": "head/"}, r"draft = 'head/' .*speculative algorithm"),
        ({"speculative": SpeculativeConfig("standalone")}, r"'standalone' needs a draft"),
        ({"backend": ""}, r"backend = ''"),
    ],
)
def test_engine_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_engine_accepts_a_speculative_mapping():
    cfg = EngineConfig(speculative={"algorithm": "eagle3", "topk": 2})
    assert cfg.speculative == SpeculativeConfig("eagle3", topk=2)


# -- load_config ---------------------------------------------------------------------------


def _write(tmp_path, text: str):
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source():
    assert load_config(env={}) == (EngineConfig(), SamplingParams())


def test_precedence_cli_over_env_over_file(tmp_path):
    path = _write(
        tmp_path,
        """
        max_batch_size = 2
        page_size = 4
        dtype = "bfloat16"
        [speculative]
        algorithm = "eagle"
        num_steps = 2
        topk = 2
        [sampling]
        temperature = 0.5
        top_p = 0.9
        """.replace("\n        ", "\n"),
    )
    env = {
        "POLYSPEC_MAX_BATCH_SIZE": "3",
        "POLYSPEC_PAGE_SIZE": "8",
        "POLYSPEC_SPECULATIVE_NUM_STEPS": "4",
        "POLYSPEC_SAMPLING_TOP_P": "0.8",
    }
    cli = {"max_batch_size": 5, "num_steps": None, "topk": 3, "temperature": 0.7}
    engine, sampling = load_config(cli=cli, config_file=path, env=env)
    assert engine.max_batch_size == 5  # cli
    assert engine.page_size == 8  # env
    assert engine.dtype == "bfloat16"  # file
    assert engine.speculative == SpeculativeConfig("eagle", num_steps=4, topk=3)
    assert sampling.temperature == 0.7 and sampling.top_p == 0.8


def test_backend_from_file_beats_env_but_env_fills_in(tmp_path):
    path = _write(tmp_path, 'backend = "cpu"\n')
    env = {"POLYSPEC_BACKEND": "example"}
    assert load_config(config_file=path, env=env)[0].backend == "cpu"
    assert load_config(cli={"backend": "x"}, config_file=path, env=env)[0].backend == "x"
    empty = _write(tmp_path, "")
    assert load_config(config_file=empty, env=env)[0].backend == "example"


def test_polyspec_toml_in_working_directory_and_polyspec_config(tmp_path):
    (tmp_path / "polyspec.toml").write_text("max_context = 1024\n")
    assert load_config(env={})[0].max_context == 1024
    other = tmp_path / "other.toml"
    other.write_text("max_context = 512\n")
    assert load_config(env={"POLYSPEC_CONFIG": str(other)})[0].max_context == 512
    assert load_config(config_file=other, env={})[0].max_context == 512


def test_prefixed_cli_keys_and_seeds():
    engine, sampling = load_config(
        cli={"speculative_algorithm": "eagle3", "seed": 7, "sampling_seed": 9}, env={}
    )
    assert engine.speculative.algorithm == "eagle3"
    assert engine.seed == 7 and sampling.seed == 9
    assert {"num_steps", "speculative_topk", "sampling_seed", "max_new_tokens"} <= cli_keys()


def test_env_values_are_parsed_per_type():
    env = {
        "POLYSPEC_NUM_KV_SLOTS": "none",
        "POLYSPEC_SAMPLING_IGNORE_EOS": "true",
        "POLYSPEC_SAMPLING_STOP": '["a", "b"]',
        "POLYSPEC_SAMPLING_STOP_TOKEN_IDS": "1, 2",
        "POLYSPEC_TARGET": "/models/x",
        "POLYSPEC_PLUGINS": "cpu",  # belongs to plugin discovery: ignored here
        "POLYSPEC_MAX_CONTEXT": "",  # empty: unset
    }
    engine, sampling = load_config(env=env)
    assert engine.num_kv_slots is None and engine.target == "/models/x"
    assert engine.max_context == 4096
    assert sampling.ignore_eos is True
    assert sampling.stop == ("a", "b") and sampling.stop_token_ids == (1, 2)


def test_algorithm_none_turns_speculation_off(tmp_path):
    path = _write(tmp_path, 'draft = "head"\n[speculative]\nalgorithm = "eagle"\n')
    assert load_config(config_file=path, env={})[0].speculative.algorithm == "eagle"
    engine, _ = load_config(cli={"algorithm": "none"}, config_file=path, env={})
    assert engine.speculative is None and engine.draft is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("max_batch = 4\n", r"unknown key 'max_batch' \(value 4\).*max_batch_size"),
        ("[speculative]\nalgorithm = 'eagle'\ndepth = 3\n", r"'speculative.depth'.*num_steps"),
        ("[sampling]\ntemp = 1.0\n", r"'sampling.temp'.*temperature"),
        ("speculative = 3\n", r"must be a table"),
        ("page_size = '4'\n", r"page_size = '4' is invalid.*integer.*config file"),
        ("[speculative]\ntopk = 2\n", r"speculative.algorithm = None.*topk.*'eagle'"),
        ("max_context = [\n", r"not valid TOML"),
    ],
)
def test_file_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(config_file=_write(tmp_path, text), env={})


def test_env_and_cli_errors_say_where_the_value_came_from():
    with pytest.raises(ConfigError, match=r"POLYSPEC_MAX_BATCH_SIZE = 'lots'.*integer"):
        load_config(env={"POLYSPEC_MAX_BATCH_SIZE": "lots"})
    with pytest.raises(ConfigError, match=r"unknown environment variable POLYSPEC_SAMPLING_TEMP"):
        load_config(env={"POLYSPEC_SAMPLING_TEMP": "1"})
    with pytest.raises(
        ConfigError, match=r"page_size = 0 .*\(set by environment POLYSPEC_PAGE_SIZE\)"
    ):
        load_config(env={"POLYSPEC_PAGE_SIZE": "0"})
    with pytest.raises(ConfigError, match=r"topk = 12 .*\(set by command line --topk\)"):
        load_config(cli={"algorithm": "eagle", "topk": 12}, env={})
    with pytest.raises(ConfigError, match=r"unknown option 'prompt'"):
        load_config(cli={"prompt": "hi"}, env={})


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file=tmp_path / "nope.toml", env={})


def test_config_error_is_a_value_error_and_a_polyspec_error():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, PolyspecError)


# -- settings a draft head recommends (polyspec.json next to it) ----------------------------


def _head(tmp_path, text: str):
    head = tmp_path / "head"
    head.mkdir()
    (head / "polyspec.json").write_text(text)
    return str(head)


def test_unset_tree_settings_come_from_the_heads_polyspec_json(tmp_path):
    head = _head(tmp_path, '{"speculative": {"num_steps": 4, "topk": 2, "num_draft_tokens": 7}}')

    def spec(**cli):
        return load_config(cli={"algorithm": "eagle3", "draft": head, **cli}, env={})[0].speculative

    assert spec() == SpeculativeConfig("eagle3", num_steps=4, topk=2, num_draft_tokens=7)
    # what the user sets wins; N is the head's only on the head's own tree
    assert spec(num_draft_tokens=5) == SpeculativeConfig("eagle3", 4, 2, 5)
    assert spec(topk=1) == SpeculativeConfig("eagle3", num_steps=4, topk=1)
    assert spec(num_steps=2).num_draft_tokens == SpeculativeConfig("eagle3", 2, 2).num_draft_tokens
    env = {"POLYSPEC_SPECULATIVE_TOPK": "3"}
    got = load_config(cli={"algorithm": "eagle3", "draft": head}, env=env)[0].speculative
    assert (got.num_steps, got.topk, got.num_draft_tokens) == (4, 3, 8)


def test_dynamic_depth_comes_from_the_head_with_its_own_tree(tmp_path):
    head = _head(
        tmp_path,
        '{"speculative": {"num_steps": 4, "topk": 2, "num_draft_tokens": 7, "dynamic_depth": 0.1}}',
    )

    def spec(**cli):
        return load_config(cli={"algorithm": "eagle3", "draft": head, **cli}, env={})[0].speculative

    assert spec().dynamic_depth == 0.1
    assert spec(dynamic_depth=0).dynamic_depth == 0.0  # the user's 0 turns it off
    assert spec(dynamic_depth="0.25").dynamic_depth == 0.25  # CLI text
    assert spec(topk=3).dynamic_depth is None  # chosen for the head's tree, not another
    # a tree given in full is the user's own: the head's file is not read
    assert spec(num_steps=4, topk=2, num_draft_tokens=7).dynamic_depth is None
    env = {"POLYSPEC_SPECULATIVE_DYNAMIC_DEPTH": "none"}
    got = load_config(cli={"algorithm": "eagle3", "draft": head}, env=env)[0].speculative
    assert got.dynamic_depth == 0.1  # unset again: the head's value


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, True, "0.1", float("nan")])
def test_dynamic_depth_must_be_a_probability_below_one(value):
    with pytest.raises(ConfigError, match=r"speculative.dynamic_depth .* is invalid: must be a"):
        SpeculativeConfig("eagle3", dynamic_depth=value)
    assert SpeculativeConfig("eagle3", dynamic_depth=0).dynamic_depth == 0.0


def test_a_bad_dynamic_depth_in_a_head_file_is_an_error(tmp_path):
    head = _head(tmp_path, '{"speculative": {"num_steps": 4, "dynamic_depth": 1.2}}')
    with pytest.raises(ConfigError, match=r"dynamic_depth must be a number in \[0, 1\)"):
        load_config(cli={"algorithm": "eagle3", "draft": head}, env={})


def test_a_speculative_mapping_takes_the_heads_settings_too(tmp_path):
    head = _head(tmp_path, '{"speculative": {"num_steps": 4, "topk": 2, "num_draft_tokens": 7}}')
    cfg = EngineConfig(draft=head, speculative={"algorithm": "eagle3", "topk": 2})
    assert cfg.speculative == SpeculativeConfig("eagle3", 4, 2, 7)
    # a SpeculativeConfig is taken as it is: its fields are all set
    cfg = EngineConfig(draft=head, speculative=SpeculativeConfig("eagle3"))
    assert cfg.speculative == SpeculativeConfig("eagle3", 3, 1, 4)


def test_the_shipped_heads_settings_apply_where_the_engine_uses_it(tmp_path):
    from polyspec.defaults import shipped_head_path, shipped_head_settings

    if shipped_head_path() is None:
        pytest.skip("no head shipped")
    shipped = shipped_head_settings()
    candidates = shipped.pop("candidates", [])
    batch_trees = shipped.pop("batch_trees", [])
    got = load_config(cli={"algorithm": "eagle3"}, env={})[0].speculative
    assert {k: getattr(got, k) for k in shipped} == shipped
    assert [dataclasses.asdict(c) for c in got.tree_candidates] == candidates
    assert [dataclasses.asdict(t) for t in got.batch_trees] == batch_trees
    # a tree setting given, or auto_tree off: the tree is the user's, no candidates
    for cli in ({"algorithm": "eagle3", "topk": 2}, {"algorithm": "eagle3", "auto_tree": False}):
        assert load_config(cli=cli, env={})[0].speculative.tree_candidates == ()
    # another target, or an EAGLE-1 head, gets the plain defaults: the shipped head is not used
    other = load_config(cli={"algorithm": "eagle3", "target": "some/model"}, env={})[0]
    assert other.speculative == SpeculativeConfig("eagle3")
    assert load_config(cli={"algorithm": "eagle"}, env={})[0].speculative == SpeculativeConfig(
        "eagle"
    )


def test_a_head_without_settings_keeps_the_defaults(tmp_path):
    (tmp_path / "bare").mkdir()
    cli = {"algorithm": "eagle3", "draft": str(tmp_path / "bare")}
    assert load_config(cli=cli, env={})[0].speculative == SpeculativeConfig("eagle3")
    cli = {"algorithm": "standalone", "draft": _head(tmp_path, '{"speculative": {"topk": 4}}')}
    assert load_config(cli=cli, env={})[0].speculative == SpeculativeConfig("standalone")


@pytest.mark.parametrize(
    "text",
    ["not json", '{"tree": {}}', '{"speculative": {"depth": 3}}', '{"speculative": {"topk": "2"}}'],
)
def test_a_bad_head_settings_file_is_an_error_naming_it(tmp_path, text):
    head = _head(tmp_path, text)
    with pytest.raises(ConfigError, match=r"head.polyspec\.json is not a valid head settings"):
        load_config(cli={"algorithm": "eagle3", "draft": head}, env={})
    # settings given in full never read it
    cli = {"algorithm": "eagle3", "draft": head, "num_steps": 2, "topk": 1, "num_draft_tokens": 3}
    assert load_config(cli=cli, env={})[0].speculative == SpeculativeConfig("eagle3", 2, 1, 3)


def test_batch_trees_pick_a_tree_by_batch_size():
    spec = SpeculativeConfig("eagle3", 3, 6, 16, batch_trees="8:3-3-8, 24:3-2-6")
    assert spec.batch_trees == (BatchTree(8, 3, 3, 8), BatchTree(24, 3, 2, 6))
    assert spec.trees == ((1, 3, 6, 16), (8, 3, 3, 8), (24, 3, 2, 6))
    got = [spec.tree_for(bs) for bs in (1, 7, 8, 23, 24, 100)]
    assert got == [(3, 6, 16), (3, 6, 16), (3, 3, 8), (3, 3, 8), (3, 2, 6), (3, 2, 6)]
    # the mapping form (a head's polyspec.json, TOML), N left to its default
    tree = [{"min_batch_size": 4, "num_steps": 2, "topk": 1}]
    assert SpeculativeConfig("eagle3", batch_trees=tree).batch_trees == (BatchTree(4, 2, 1, 3),)
    assert SpeculativeConfig("eagle3", batch_trees="none").batch_trees == ()
    assert BatchTree(8, 3, 3, 8).text == "8:3-3-8"


def test_batch_trees_plain_rounds():
    """``MIN:plain`` (or num_steps 0 in the mapping form): plain rounds from that batch size."""
    spec = SpeculativeConfig("eagle3", 3, 6, 16, batch_trees="8:3-3-8, 64:PLAIN")
    assert spec.batch_trees == (BatchTree(8, 3, 3, 8), BatchTree(64, 0, 1, 1))
    assert [t.text for t in spec.batch_trees] == ["8:3-3-8", "64:plain"]
    assert [t.label for t in spec.batch_trees] == ["S=3 K=3 N=8", "plain"]
    assert spec.tree_for(63) == (3, 3, 8) and spec.tree_for(64) == (0, 1, 1)
    tree = [{"min_batch_size": 16, "num_steps": 0}]
    assert SpeculativeConfig("eagle3", batch_trees=tree).batch_trees == (BatchTree(16, 0),)
    full = [{"min_batch_size": 16, "num_steps": 0, "topk": 1, "num_draft_tokens": 1}]
    assert SpeculativeConfig("eagle3", batch_trees=full).batch_trees[0].plain
    assert parse_batch_trees("4:0-1-1") == (BatchTree(4, 0),)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("8:3-3", r"'8:3-3' is not MIN_BATCH:S-K-N"),
        ("8:plane", r"'8:plane' is not MIN_BATCH:S-K-N or MIN_BATCH:plain"),
        ("1:plain", r"min_batch_size = 1 is invalid: must be an integer >= 2"),
        ("8:0-1-2", r"num_draft_tokens = 2 is invalid: a plain entry \(num_steps = 0\)"),
        ("8:0-2-1", r"topk = 2 is invalid: a plain entry \(num_steps = 0\)"),
        ("8:plain,8:3-3-8", r"min_batch_size must strictly increase"),
        ("8-3-3-8", r"is not MIN_BATCH:S-K-N"),
        ("a:3-3-8", r"invalid literal"),
        ("1:3-3-8", r"min_batch_size = 1 is invalid: must be an integer >= 2"),
        ("8:3-9-8", r"speculative.topk = 9 is invalid"),
        ("8:3-1-8", r"with topk = 1 the tree is a chain"),
        ("8:3-3-8,4:3-2-6", r"min_batch_size must strictly increase"),
        ("8:3-3-8,8:3-2-6", r"min_batch_size must strictly increase"),
        ([{"min_batch_size": 4, "steps": 3}], r"unknown keys \['steps'\]"),
        ([{"min_batch_size": 4}], r"must be MIN_BATCH:S-K-N or MIN_BATCH:plain entries"),
        (8, r"must be MIN_BATCH:S-K-N or MIN_BATCH:plain entries"),
    ],
)
def test_bad_batch_trees_say_what_is_wrong(value, match):
    with pytest.raises(ConfigError, match=r"speculative.batch_trees = .* is invalid: "):
        SpeculativeConfig("eagle3", batch_trees=value)
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig("eagle3", batch_trees=value)


def test_batch_trees_from_cli_env_and_file(tmp_path):
    cli = {"algorithm": "eagle3", "num_steps": 3, "topk": 4, "num_draft_tokens": 10}
    got = load_config(cli={**cli, "batch_trees": "8:3-2-6"}, env={})[0].speculative
    assert got.batch_trees == (BatchTree(8, 3, 2, 6),)
    env = {"POLYSPEC_SPECULATIVE_BATCH_TREES": "4:2-2-4,16:2-1-3"}
    got = load_config(cli=cli, env=env)[0].speculative
    assert [t.text for t in got.batch_trees] == ["4:2-2-4", "16:2-1-3"]
    path = tmp_path / "c.toml"
    path.write_text(
        '[speculative]\nalgorithm = "eagle3"\n'
        "batch_trees = [{min_batch_size = 8, num_steps = 3, topk = 3, num_draft_tokens = 8}]\n"
    )
    got = load_config(config_file=path, env={})[0].speculative
    assert got.batch_trees == (BatchTree(8, 3, 3, 8),)
    with pytest.raises(ConfigError, match=r"'8:3' is not MIN_BATCH:S-K-N"):
        load_config(cli={**cli, "batch_trees": "8:3"}, env={})


def test_batch_trees_come_from_the_head_with_its_own_tree(tmp_path):
    head = _head(
        tmp_path,
        '{"speculative": {"num_steps": 3, "topk": 6, "num_draft_tokens": 16, "batch_trees": '
        '[{"min_batch_size": 8, "num_steps": 3, "topk": 3, "num_draft_tokens": 8}], '
        '"candidates": [{"num_steps": 1, "topk": 1, "num_draft_tokens": 2, "acceptance": 1.5}]}}',
    )

    def spec(**cli):
        return load_config(cli={"algorithm": "eagle3", "draft": head, **cli}, env={})[0].speculative

    assert spec().batch_trees == (BatchTree(8, 3, 3, 8),)
    assert spec().tree_candidates  # no tree setting given: the engine may still choose one
    assert spec(topk=2).batch_trees == ()  # chosen with the head's tree, not another
    assert spec(batch_trees="none").batch_trees == ()  # turned off by the user ...
    assert spec(batch_trees="none").tree_candidates  # ... which gives no tree of theirs
    mine = spec(batch_trees="4:2-1-3")  # the user's own: no candidates to replace them
    assert mine.batch_trees == (BatchTree(4, 2, 1, 3),) and mine.tree_candidates == ()
    assert (mine.num_steps, mine.topk, mine.num_draft_tokens) == (3, 6, 16)


@pytest.mark.parametrize(
    "trees",
    ['{"min_batch_size": 8}', '"8:3-3-8"', '{"min_batch_size": 8, "num_steps": 3, "topk": 3, '
     '"num_draft_tokens": 8, "acceptance": 2.5}'],
)  # fmt: skip
def test_a_bad_batch_tree_in_a_head_file_is_an_error(tmp_path, trees):
    head = _head(tmp_path, f'{{"speculative": {{"num_steps": 3, "batch_trees": [{trees}]}}}}')
    with pytest.raises(ConfigError, match=r"batch_trees must be a list of \{min_batch_size"):
        load_config(cli={"algorithm": "eagle3", "draft": head}, env={})


def test_overlap_rounds_is_an_engine_switch(tmp_path):
    assert EngineConfig().overlap_rounds == "auto"
    assert EngineConfig(overlap_rounds=True).overlap_rounds == "on"
    assert EngineConfig(overlap_rounds=False).overlap_rounds == "off"
    assert load_config(cli={"overlap_rounds": "on"}, env={})[0].overlap_rounds == "on"
    for text, mode in (("yes", "on"), ("0", "off"), ("Auto", "auto")):
        env = {"POLYSPEC_OVERLAP_ROUNDS": text}
        assert load_config(env=env)[0].overlap_rounds == mode, text
    for toml, mode in (("true", "on"), ("false", "off"), ('"auto"', "auto"), ('"off"', "off")):
        (tmp_path / "p.toml").write_text(f"overlap_rounds = {toml}\n")
        assert load_config(config_file=tmp_path / "p.toml", env={})[0].overlap_rounds == mode
    with pytest.raises(
        ConfigError, match=r"POLYSPEC_OVERLAP_ROUNDS = 'maybe' is invalid: expected auto"
    ):
        load_config(env={"POLYSPEC_OVERLAP_ROUNDS": "maybe"})
    with pytest.raises(
        ConfigError, match=r"overlap_rounds = 1 is invalid: must be 'auto', 'on' or"
    ):
        EngineConfig(overlap_rounds=1)


def test_overlap_rounds_auto_follows_async_host_reads():
    """``auto`` queues rounds only where the backend says its host reads are asynchronous."""
    from polyspec.backend import BackendCapabilities
    from polyspec.spec.base import uses_overlap

    sync, ahead = BackendCapabilities(), BackendCapabilities(async_host_reads=True)
    assert [uses_overlap(sync, m) for m in ("auto", "on", "off")] == [False, True, False]
    assert [uses_overlap(ahead, m) for m in ("auto", "on", "off")] == [True, True, False]


def test_max_graph_batch_size_defaults_to_auto(tmp_path):
    """None (or "auto") covers max_batch_size; an integer caps it, from any layer."""
    assert EngineConfig().max_graph_batch_size is None
    assert EngineConfig(max_graph_batch_size="auto").max_graph_batch_size is None
    assert EngineConfig(max_graph_batch_size=16).max_graph_batch_size == 16
    assert load_config(cli={"max_graph_batch_size": "24"}, env={})[0].max_graph_batch_size == 24
    env = {"POLYSPEC_MAX_GRAPH_BATCH_SIZE": "auto"}
    assert load_config(env=env)[0].max_graph_batch_size is None
    (tmp_path / "p.toml").write_text('max_graph_batch_size = "auto"\n')
    assert load_config(config_file=tmp_path / "p.toml", env={})[0].max_graph_batch_size is None
    with pytest.raises(ConfigError, match=r"max_graph_batch_size = 0 is invalid"):
        EngineConfig(max_graph_batch_size=0)
    with pytest.raises(ConfigError, match=r"expected an integer or 'auto'"):
        load_config(env={"POLYSPEC_MAX_GRAPH_BATCH_SIZE": "many"})


def test_serve_batch_default_where_the_backend_captures_graphs(monkeypatch):
    """``polyspec serve`` raises max_batch_size to SERVE_MAX_BATCH_SIZE only where no layer
    sets it and the backend captures graphs (the ascend-like test plugin declares
    graph_capture; the cpu backend does not)."""
    from polyspec.cli import build_parser
    from polyspec.commands.serve import SERVE_MAX_BATCH_SIZE, serve_batch_default

    monkeypatch.delenv("POLYSPEC_MAX_BATCH_SIZE", raising=False)

    def args(*flags):
        return build_parser().parse_args(["serve", *flags])

    captures = args("--backend", "ascend-like")
    assert "max_batch_size = 128" in serve_batch_default(captures)
    assert captures.max_batch_size == SERVE_MAX_BATCH_SIZE == 128
    for kept in (
        args("--backend", "cpu"),
        args("--backend", "ascend-like", "--max-batch-size", "4"),
    ):
        before = kept.max_batch_size
        assert serve_batch_default(kept) is None and kept.max_batch_size == before
    monkeypatch.setenv("POLYSPEC_MAX_BATCH_SIZE", "16")  # set by the environment: kept
    from_env = args("--backend", "ascend-like")
    assert serve_batch_default(from_env) is None and from_env.max_batch_size is None
