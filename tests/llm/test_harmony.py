"""The harmony chat format (genfast/llm/harmony.py): replies split into channels however the text
streams, a harmony tokenizer's stop tokens and decoded markers, and `genfast chat` showing the
final answer with the analysis set apart (on a tiny gpt-oss model whose reply is scripted: a random
model writes no harmony)."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from genfast import cli
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.tokenizer import Tokenizer, load_tokenizer
from genfast.llm.decoding.generate import Completions, Generator
from genfast.llm.harmony import HarmonyStream, Message, parse_messages, split_reply
from tests.llm.hf_fixtures import save_hf_model
from tests.llm.model.test_gpt_oss import make_gpt_oss

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
# A template shaped like gpt-oss's: each turn `<|start|>ROLE<|message|>TEXT<|end|>`, the reply
# opened with `<|start|>assistant`.
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
REPLY = "<|channel|>analysis<|message|>We think <|x|> hard.<|end|><|start|>assistant<|channel|>final<|message|>Hi <b>!"


def test_a_reply_splits_into_its_channels_however_it_streams():
    assert split_reply(REPLY) == {"analysis": "We think <|x|> hard.", "final": "Hi <b>!"}
    for size in (1, 2, 5):
        stream = HarmonyStream()
        pieces = [p for i in range(0, len(REPLY), size) for p in stream.push(REPLY[i : i + size])]
        pieces += stream.finish()
        assert "".join(t for c, t in pieces if c == "analysis") == "We think <|x|> hard."
        assert stream.text() == "Hi <b>!"
    # A tool call's channel is its kind; a message without a channel header is the answer.
    call = "<|channel|>commentary to=functions.get json<|message|>{}<|call|>"
    assert split_reply(call) == {"commentary": "{}"}
    assert split_reply("plain <|message|>text") == {"final": "plain text"}


def harmony_tokenizer(vocab_size: int, generation_stop: list[int] | None = None) -> Tokenizer:
    """Words w0.., the reply's header words and the harmony markers as special tokens (the last ids)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    names = ["assistant", "analysis", "final"]  # the reply's role and channels
    words = vocab_size - len(MARKERS) - len(names)
    vocab = {f"w{i}": i for i in range(words)} | {name: words + i for i, name in enumerate(names)}
    backend = Backend(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return Tokenizer(backend, stop_ids=set(generation_stop or ()), chat_template=TEMPLATE)


def test_a_harmony_tokenizer_stops_at_return_and_call_only_and_keeps_its_markers(tmp_path):
    tok = harmony_tokenizer(64)
    end, ret, call = (tok.backend.token_to_id(m) for m in ("<|end|>", "<|return|>", "<|call|>"))
    tok.stop_ids = {end}  # as a config listing <|end|> would: it only ends a message
    tok.save(tmp_path)
    loaded = load_tokenizer(SimpleNamespace(format="hf", path=tmp_path))
    assert loaded.harmony and loaded.stop_ids == {ret, call}
    ids = loaded.encode("<|channel|> w3 <|message|> w4 w5 <|end|>")
    assert loaded.decode(ids).split() == ["<|channel|>", "w3", "<|message|>", "w4", "w5", "<|end|>"]
    # Without the harmony markers, <|end|> stays a stop token (Phi-3's end of turn).
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    plain = Tokenizer(Backend(models.WordLevel({"w0": 0, "<|end|>": 1}, unk_token="w0")), stop_ids={1})
    assert not plain.harmony and plain.stop_ids == {1}


@pytest.fixture
def harmony_model(tmp_path) -> Path:
    hf = make_gpt_oss()
    directory = save_hf_model(hf, tmp_path / "gpt-oss")
    harmony_tokenizer(hf.config.vocab_size).save(directory)
    return directory


def test_chat_shows_the_final_answer_and_sets_the_analysis_apart(harmony_model, monkeypatch, capsys):
    tokenizer = load_tokenizer(Checkpoint.open(harmony_model))
    replies = [
        "<|channel|> analysis <|message|> w5 w6 <|end|> "
        "<|start|> assistant <|channel|> final <|message|> w7 w8 <|return|>",
        "<|channel|> final <|message|> w9 <|return|> w10",  # nothing after <|return|> is shown
    ]
    prompts: list[str] = []

    def scripted_generate(self, prompts_ids, max_new_tokens, params=None, stop_strings=(), seed=None,
                          on_text=None, stop_at_eos=True):  # fmt: skip
        prompts.append(self.tokenizer.decode(prompts_ids[0]))
        out = Completions(self.tokenizer, 1, stop_strings, stop_at_eos, on_text)
        for token in tokenizer.encode(replies[len(prompts) - 1]):
            out.push(0, token)
        return out.finish(prompt_tokens=len(prompts_ids[0]), prefill_s=0.1, decode_s=0.1, decode_steps=1)

    monkeypatch.setattr(Generator, "generate", scripted_generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2\nw3\n/exit\n"))
    argv = ["chat", "--model", str(harmony_model), "--dtype", "float32", "--no-compile", "-n", "20"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["w7", "w8", "w9"]
    assert "[analysis] w5 w6" in " ".join(err.split())
    # The next turn's prompt carries the earlier answer, not its analysis.
    assert "<|start|> assistant <|message|> w7 w8 <|end|>" in " ".join(prompts[1].split())
    assert "w5" not in prompts[1]


def test_the_server_answers_with_the_final_channel_and_the_analysis_as_reasoning():
    from genfast.serve.engine import Finished
    from genfast.serve.protocol import ResponseHeader

    finished = Finished(REPLY, [1, 2, 3], "stop", 5)
    message = ResponseHeader("chat", "m", harmony=True).response(finished)["choices"][0]["message"]
    assert message["content"] == "Hi <b>!" and message["reasoning_content"] == "We think <|x|> hard."
    assert ResponseHeader("chat", "m").response(finished)["choices"][0]["message"]["content"] == REPLY
    streamed = ResponseHeader("chat", "m", harmony=True)
    chunks = [streamed.chunk(REPLY[i : i + 4]) for i in range(0, len(REPLY), 4)] + [streamed.chunk(None, "stop")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Hi <b>!"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "We think <|x|> hard."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# A call as gpt-oss writes it: the analysis, then a commentary message addressed to the function,
# the recipient before or after the channel (both occur); `<|call|>` itself is a stop text, cut.
CALLS = [
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary json<|message|>{"city": "Paris"}',
]


@pytest.mark.parametrize("reply", CALLS)
def test_a_message_to_a_function_is_a_tool_call(reply):
    from genfast.serve.engine import Finished
    from genfast.serve.protocol import ResponseHeader

    [analysis, call] = parse_messages(reply)
    assert analysis == Message("analysis", None, "Need the weather.")
    assert call == Message("commentary", "functions.get_weather", '{"city": "Paris"}')
    finished = Finished(reply, [1, 2, 3], "stop", 5)
    [choice] = ResponseHeader("chat", "m", {"get_weather"}, harmony=True).response(finished)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "Need the weather."
    [tool_call] = message["tool_calls"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = ResponseHeader("chat", "m", {"get_weather"}, harmony=True).held_reply_chunks(finished, None)
    delta = chunks[0]["choices"][0]["delta"]
    assert delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert delta["reasoning_content"] == "Need the weather."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_of_an_unknown_function_or_with_bad_arguments_stays_text():
    from genfast.serve.engine import Finished
    from genfast.serve.protocol import ResponseHeader

    for names, reply in (({"get_time"}, CALLS[0]), ({"get_weather"}, CALLS[0].replace('{"city"', '["city"'))):
        finished = Finished(reply, [1, 2, 3], "stop", 5)
        [choice] = ResponseHeader("chat", "m", names, harmony=True).response(finished)["choices"]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == ""  # no final channel: nothing for the user
    # Held back while streaming (tools offered), a reply without calls still sets its analysis apart.
    finished = Finished(REPLY, [1, 2, 3], "stop", 5)
    chunks = ResponseHeader("chat", "m", {"get_weather"}, harmony=True).held_reply_chunks(finished, None)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Hi <b>!"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "We think <|x|> hard."


def test_text_before_any_header_is_final_and_text_after_the_end_is_dropped():
    assert parse_messages("Hello") == [Message("final", None, "Hello")]
    assert parse_messages("<|channel|>final<|message|>w9<|return|> w10") == [Message("final", None, "w9")]


def test_a_gpt_oss_gguf_vocabulary_pre_tokenizes_as_o200k_and_is_harmony():
    """llama.cpp writes gpt-oss's vocabulary with pre-tokenizer 'gpt-4o' (o200k: words split where
    case turns upward, digits by three) and the markers as control tokens; a GGUF's end-of-turn
    id (<|end|>) must not stop a harmony reply."""
    from tokenizers import pre_tokenizers

    from genfast.llm.checkpoints.tokenizer import gguf_tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet) + MARKERS
    ids = {t: i for i, t in enumerate(tokens)}
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(alphabet) + [3] * len(MARKERS),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": ids["<|return|>"],
        "tokenizer.ggml.eot_token_id": ids["<|end|>"],
    }
    tok = gguf_tokenizer(meta)
    assert tok.harmony and tok.stop_ids == {ids["<|return|>"], ids["<|call|>"]}
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("HelloWorld it's 12345 CAPS.\n")]
    assert pieces == ["Hello", "World", "Ġit's", "Ġ", "123", "45", "ĠCAPS", ".Ċ"]
    assert tok.decode(tok.encode("<|start|>Hi<|end|>")) == "<|start|>Hi<|end|>"
