"""``--prompts FILE`` (decode/harness/prompts.py): JSONL with "text" or "messages", plain text lines, and one-line errors
naming the file, the line and the fix."""

import hashlib
import json
import re

import pytest

from dartree.decode.harness.prompts import load_prompt_file


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_text_lines_in_file_order_with_the_file_as_data_set(tmp_path):
    f = _write(tmp_path / "mine.jsonl", json.dumps({"text": "Add 2 and 3.", "source": "ignored"}) + "\n\n"
               + json.dumps({"text": "Name a prime.", "id": 7}) + "\n")
    prompts, record = load_prompt_file(f)
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    name = f"{f} sha256:{digest}"
    assert [(p.dataset, p.id, p.text, p.messages) for p in prompts] == [
        (name, "1", "Add 2 and 3.", None), (name, "3", "Name a prime.", None)]  # ids: line numbers; blank skipped
    assert record == {"path": str(f.resolve()), "sha256": digest, "format": "jsonl", "name": name, "prompts": 2}
    assert [p.text for p in load_prompt_file(f, limit=1)[0]] == ["Add 2 and 3."]  # --limit: the first N


def test_jsonl_messages_keep_the_chat_and_show_its_last_turn(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 x 6?"}]
    f = _write(tmp_path / "chat.jsonl", json.dumps({"messages": chat}) + "\n")
    (p,), record = load_prompt_file(f)
    assert p.messages == chat and p.text == "What is 7 x 6?" and p.id == "1" and record["format"] == "jsonl"
    # a chat dataset's row ends with the answer: the prompt is the chat up to its last user turn, as for ShareGPT
    answered = chat + [{"role": "assistant", "content": "42."}]
    f = _write(tmp_path / "answered.jsonl", json.dumps({"messages": answered}) + "\n")
    (p,), _ = load_prompt_file(f)
    assert p.messages == chat and p.text == "What is 7 x 6?"


def test_text_file_one_prompt_per_line(tmp_path):
    f = _write(tmp_path / "mine.txt", "First prompt.\n\n  Second, indented.\r\n{\"text\": \"not JSON here\"}\n")
    prompts, record = load_prompt_file(f)
    assert [(p.id, p.text) for p in prompts] == [("1", "First prompt."), ("3", "  Second, indented."),
                                                 ("4", '{"text": "not JSON here"}')]  # .txt is never parsed
    assert record["format"] == "text" and record["prompts"] == 3
    # any other suffix: JSONL when its first line is an object, else text
    assert load_prompt_file(_write(tmp_path / "p.data", '{"text": "a"}\n'))[1]["format"] == "jsonl"
    assert load_prompt_file(_write(tmp_path / "p.md", "plain\n"))[1]["format"] == "text"


@pytest.mark.parametrize("name, content, expected", [
    ("no_field.jsonl", '{"text": "ok"}\n{"input_text": "x"}\n', r":2: no prompt field \(fields \['input_text'\]\)"),
    ("bad_json.jsonl", '{"text": "ok"}\n{"text": "unterminated\n', r":2: not JSON \(Unterminated string"),
    ("list.jsonl", '["text"]\n', r":1: a JSON list, not an object"),
    ("number_text.jsonl", '{"text": 5}\n', r":1: \"text\" is int, not a string"),
    ("bad_turns.jsonl", '{"turns": []}\n', r":1: \"turns\" is not a non-empty list of strings"),
    ("bad_sharegpt.jsonl", '{"conversations": [{"from": "gpt", "value": "hi"}]}\n', r":1: \"conversations\" has no human"),
    ("empty_messages.jsonl", '{"messages": []}\n', r":1: \"messages\" is an empty list"),
    ("bad_message.jsonl", '{"messages": [{"role": "user"}]}\n', r":1: \"messages\"\[0\] is not an object with"),
    ("no_user.jsonl", '{"messages": [{"role": "assistant", "content": "hi"}]}\n', r":1: \"messages\" has no \"user\" turn"),
    ("empty_user.jsonl", '{"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "hi"}]}\n',
     r":1: \"messages\"\[0\], the last user turn, is empty"),
    ("empty.jsonl", "", r": holds no prompt \(empty or blank lines only\)"),
    ("blank.txt", "\n  \n", r": holds no prompt"),
])
def test_bad_files_are_one_line_errors_naming_file_line_and_fix(tmp_path, name, content, expected):
    f = _write(tmp_path / name, content)
    with pytest.raises(ValueError) as info:
        load_prompt_file(f)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(str(f))
    assert re.search(expected, msg), msg
    if name != "blank.txt":
        assert 'give one JSON object per line with a "text" (or "prompt", "question", "instruction") string' in msg


def test_missing_and_non_utf8_files_and_bad_limit(tmp_path):
    with pytest.raises(ValueError, match=r"nope.jsonl: cannot read the prompt file .*give an existing"):
        load_prompt_file(tmp_path / "nope.jsonl")
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: byte 3 is not UTF-8; save the prompt file as UTF-8"):
        load_prompt_file(f)
    with pytest.raises(ValueError, match="limit=-1 must be an integer >= 0"):
        load_prompt_file(_write(tmp_path / "ok.txt", "a\n"), limit=-1)


def test_messages_render_through_the_chat_template_as_a_user_turn_does():
    from dartree.models.chat import messages_prompt_ids
    from dartree.models.target import resolve_target_path
    from dartree.models.chat import chat_prompt_ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2"))
    text = "What is 7 x 6?"
    one = messages_prompt_ids(tok, [{"role": "user", "content": text}])
    assert one == chat_prompt_ids(tok, text)  # a one-turn chat is a packaged set's prompt
    chat = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": text}]
    ids = messages_prompt_ids(tok, chat)
    rendered = tok.decode(ids)
    assert rendered.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")  # the file's system turn
    assert rendered.endswith(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")  # + generation prompt
    assert tok.decode(one).endswith(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n") and ids != one


@pytest.mark.parametrize("script", ["eval", "bench"])
def test_eval_and_bench_refuse_a_bad_prompt_file_in_one_line_before_loading_a_model(tmp_path, capsys, script):
    import importlib

    mod = importlib.import_module(f"dartree.decode.{script}")
    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": "ok"}\nnot json\n')
    assert mod.main(["--prompts", str(bad), "--target", str(tmp_path / "no-such-target")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --prompts {bad}:3: not JSON (Expecting value at column 1)")
    with pytest.raises(SystemExit) as info:  # the packaged sets and a file are mutually exclusive
        mod.main(["--prompts", str(bad), "--datasets", "gsm8k"])
    assert info.value.code == 2 and "argument --datasets: not allowed with argument --prompts" in capsys.readouterr().err


def test_the_shapes_other_tools_write_and_a_byte_order_mark(tmp_path):
    # vLLM / SGLang benchmark files ("prompt"), GSM8K ("question"), Alpaca ("instruction" + "input"), MT-Bench question
    # files ("turns": the first), ShareGPT ("conversations", cut after the last human turn), saved with a BOM
    rows = [{"prompt": "Say hi.", "output_len": 64}, {"question": "What is 2 + 2?", "answer": "4"},
            {"instruction": "Translate.", "input": "Bonjour"}, {"instruction": "List primes.", "input": ""},
            {"question_id": 81, "turns": ["Write a poem.", "Now shorter."]},
            {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Bye"},
                               {"from": "gpt", "value": "Bye!"}]}]
    f = tmp_path / "other.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode("utf-8"))
    prompts, record = load_prompt_file(f)
    assert [p.text for p in prompts] == ["Say hi.", "What is 2 + 2?", "Translate.\n\nBonjour", "List primes.",
                                         "Write a poem.", "Bye"]
    assert [p.messages for p in prompts[:5]] == [None] * 5 and record["format"] == "jsonl"
    assert prompts[5].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    t = tmp_path / "bom.txt"
    t.write_bytes(b"\xef\xbb\xbfFirst prompt.\nSecond.\n")
    assert [p.text for p in load_prompt_file(t)[0]] == ["First prompt.", "Second."]  # no U+FEFF in the text


def test_a_json_array_file_and_empty_prompts(tmp_path):
    # ShareGPT's released file is one JSON array (often pretty-printed): its rows, numbered by element
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
            {"prompt": "Say hi."}]
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps(rows, indent=2))
    prompts, record = load_prompt_file(f)
    assert [(p.id, p.text) for p in prompts] == [("1", "Hi"), ("2", "Say hi.")] and record["format"] == "json"
    for name, content, expected in (
            ("bad_element.json", '[{"text": "ok"}, 5]', r":2: a JSON int, not an object"),
            ("broken.json", '[{"text": "ok"},\n', r":1: not a JSON array \(Expecting value"),
            ("empty_text.jsonl", '{"text": "  "}\n', r':1: "text" is empty'),
            ("empty_turn.jsonl", '{"messages": [{"role": "user", "content": ""}]}\n', r':1: "messages"\[0\], the last user '
                                                                                        r"turn, is empty")):
        with pytest.raises(ValueError, match=expected):
            load_prompt_file(_write(tmp_path / name, content))
