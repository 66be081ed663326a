"""lm-evaluation-harness on our model through its `hf` model type (HFLM), with a tiny model and a
word-level tokenizer built locally (no download): loglikelihood and generate_until requests,
checked against the log-probabilities and greedy generations of the model itself."""
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from test_hf_model import DEVICES, tiny_model, tiny_tokenizer  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def _expected_loglikelihood(model, tokenizer, context, continuation, device):
    ctx = tokenizer(context).input_ids
    cont = tokenizer(continuation).input_ids
    ids = torch.tensor([ctx + cont], device=device)
    with torch.no_grad():
        logprobs = model(input_ids=ids[:, :-1]).logits.float().log_softmax(-1)[0, len(ctx) - 1:]
    target = torch.tensor(cont, device=device)
    total = logprobs.gather(-1, target[:, None]).sum().item()
    return total, bool((logprobs.argmax(-1) == target).all())


def _expected_generation(model, tokenizer, context, until, max_gen_toks, device):
    ids = torch.tensor([tokenizer(context).input_ids], device=device)
    new = model.fox_model.generate(ids, max_new_tokens=max_gen_toks)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in new:  # generation stops there (the config's eos_token_id)
        new = new[:new.index(tokenizer.eos_token_id)]
    text = tokenizer.decode(new, skip_special_tokens=True)
    for term in until:
        text = text.split(term)[0]
    return text


@pytest.mark.parametrize("device", DEVICES)
def test_hflm_loglikelihood_and_generate_until(checkpoint, device):
    import forgetting_transformer.model  # noqa: F401  (registers the classes)

    lm = HFLM(pretrained=str(checkpoint), device=device, batch_size=2, dtype="float32")
    model, tokenizer = lm.model, lm.tokenizer
    assert type(model).__name__ == "ForgettingTransformerForCausalLM"

    pairs = [("the cat sat on", " the mat"), ("a big red car ran", " up the hill and down"),
             ("one two three", " four"), ("the sun is warm and the moon is", " cold")]
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    assert len(results) == len(pairs)
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        want, want_greedy = _expected_loglikelihood(model, tokenizer, context, continuation,
                                                    lm.device)
        assert logprob == pytest.approx(want, rel=1e-4, abs=1e-4), (context, continuation)
        assert greedy == want_greedy

    # Contexts of different lengths: the harness left-pads them into one batch.
    contexts = ["the dog ran to the old house by the river", "four five", "a bird"]
    until = ["seven"]
    requests = [Instance("generate_until", doc={},
                         arguments=(c, {"until": until, "max_gen_toks": 8, "do_sample": False}),
                         idx=i) for i, c in enumerate(contexts)]
    generations = lm.generate_until(requests)
    for context, text in zip(contexts, generations):
        assert text == _expected_generation(model, tokenizer, context, until, 8, lm.device)


TASK_YAML = """task: fox_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
def test_readme_lm_eval_command_runs(checkpoint, tmp_path):
    """The README's command line, on a task written here (a JSON file: nothing downloaded)."""
    import json
    import subprocess
    import sys
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in [
        ("the cat sat on", " the mat"), ("one two three", " four"), ("a big red", " car")]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "fox_local.yaml").write_text(TASK_YAML.format(data=data))
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf_home"))
    command = [sys.executable, "-c",
               "import forgetting_transformer.model, lm_eval.__main__ as m; m.cli_evaluate()",
               "run", "--model", "hf", "--model_args",
               f"pretrained={checkpoint},dtype=float32,backend=causal", "--tasks", "fox_local",
               "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fox_local" in out.stdout and "acc" in out.stdout, out.stdout
