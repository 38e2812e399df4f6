"""The endpoint client: the real ``openai`` client against a chat-completions server on 127.0.0.1 in this process
(no network). The request must have SandAI's shape (the fixtures' README), the reply comes back rendered, and each
failure is one error naming the endpoint. Timeouts stay under a second, with no retries."""

from __future__ import annotations

import base64
import io
import socket
import sys

import pytest
from helpers.chat_completions_stub import ChatCompletionsStub
from helpers.fixtures import golden, golden_text
from PIL import Image

from diffusers_magi2.pipelines.prompt_enhancement import Magi2PromptEnhancer
from diffusers_magi2.pipelines.prompt_enhancement_endpoint import EndpointClient


TEMPLATE = "Task text. {variation_seed}Idea: <<{user_input_text}>>"
PROMPT = "A red fox trots through fresh snow {variation_seed}"


def _case(name: str) -> tuple[str, str]:
    """(the reply text, its rendered Markdown) of a fixture case."""
    return golden_text(f"prompt_enhancement/{name}.input.json"), golden_text(
        f"prompt_enhancement/{name}.render_markdown.md"
    )


def _enhancer(server: ChatCompletionsStub, **kwargs) -> Magi2PromptEnhancer:
    kwargs = {"model": "stub-model", "api_key": "sk-test", "template": TEMPLATE, "timeout": 0.9, **kwargs}
    return Magi2PromptEnhancer.from_endpoint(server.base_url, max_retries=0, **kwargs)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_text_to_video_request_shape_and_rendered_reply():
    reply, markdown = _case("t2v_street_night_dialogue")
    with ChatCompletionsStub(reply=reply) as server:
        assert _enhancer(server)(PROMPT) == markdown
    assert server.paths == ["/v1/chat/completions"]
    (request,) = server.requests
    assert request == {
        "model": "stub-model",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Task text. Idea: <<A red fox trots through fresh snow >>"}],
            }
        ],
        "max_tokens": 16384,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "T2VEnhanceResult",
                "schema": golden("prompt_enhancement/t2v_response_schema.json"),
                "strict": True,
            },
        },
    }


def test_image_to_video_request_carries_the_schema_and_the_image_as_a_data_url(tmp_path):
    reply, markdown = _case("i2v_cooking")
    image = Image.new("RGB", (16, 12), (10, 120, 200))
    jpeg = io.BytesIO()
    image.save(jpeg, format="JPEG")
    path = tmp_path / "frame.png"
    image.save(path)
    with ChatCompletionsStub(reply=reply) as server:
        enhancer = _enhancer(server)
        assert enhancer("cook an egg", image=image) == markdown
        assert enhancer("cook an egg", image=path) == markdown
    pil_request, path_request = server.requests
    assert pil_request["response_format"]["json_schema"]["name"] == "I2VEnhanceResult"
    assert pil_request["response_format"]["json_schema"]["schema"] == golden(
        "prompt_enhancement/i2v_response_schema.json"
    )
    text_part, image_part = pil_request["messages"][0]["content"]
    assert text_part == {"type": "text", "text": "Task text. Idea: <<cook an egg>>"}
    assert image_part == {
        "type": "image_url",
        "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg.getvalue()).decode()},
    }
    path_url = path_request["messages"][0]["content"][1]["image_url"]["url"]
    assert path_url == "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    assert not {"temperature", "top_p", "seed"} & set(pil_request)


def test_the_api_key_is_sent_as_bearer_and_a_placeholder_where_none_is_set(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    client = EndpointClient("http://127.0.0.1:9/v1", "m", None, 1.0, 0)
    assert client._client.api_key == "EMPTY"
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    assert EndpointClient("http://127.0.0.1:9/v1", "m", None, 1.0, 0)._client.api_key == "from-env"
    assert EndpointClient("http://127.0.0.1:9/v1", "m", "given", 1.0, 0)._client.api_key == "given"


def test_base_url_from_the_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/from-env/v1")
    assert EndpointClient(None, "m", "k", 1.0, 0).base_url == "http://127.0.0.1:9/from-env/v1/"


def test_an_unreachable_endpoint_is_one_runtime_error_naming_it():
    url = f"http://127.0.0.1:{_free_port()}/v1"
    enhancer = Magi2PromptEnhancer.from_endpoint(url, model="m", api_key="k", timeout=0.5, max_retries=0)
    with pytest.raises(RuntimeError, match=rf"{url}/ \(model 'm'\) could not be reached"):
        enhancer("a fox")


def test_a_timeout_is_one_runtime_error_naming_the_endpoint():
    with ChatCompletionsStub(reply="{}", delay_s=0.8) as server:
        with pytest.raises(RuntimeError, match=rf"{server.base_url}/ .* did not answer within 0\.2 s"):
            _enhancer(server, timeout=0.2)("a fox")


@pytest.mark.parametrize("status", [401, 500])
def test_an_http_error_is_one_runtime_error_naming_the_endpoint_and_status(status):
    with ChatCompletionsStub(status=status) as server:
        with pytest.raises(RuntimeError, match=rf"{server.base_url}/ .* answered HTTP {status}: .*stub error"):
            _enhancer(server)("a fox")
    assert len(server.requests) == 1  # max_retries=0: no retry


def test_a_reply_that_is_not_json_or_misses_a_key_is_one_value_error_naming_the_endpoint():
    with ChatCompletionsStub(reply="Sure! Here is your caption: ...") as server:
        with pytest.raises(
            ValueError, match=rf"{server.base_url}/ \(model 'stub-model'\) replied with text that is not JSON"
        ):
            _enhancer(server)("a fox")
    with ChatCompletionsStub(reply='{"global_layer": {"context": "x"}}') as server:
        with pytest.raises(
            ValueError, match=rf"{server.base_url}/ .* lacks the required key\(s\) \['dynamic_layer'\]"
        ):
            _enhancer(server)("a fox")
    with ChatCompletionsStub(reply="") as server:
        with pytest.raises(ValueError, match="not JSON"):
            _enhancer(server)("a fox")


def test_bad_endpoint_arguments_are_refused_when_built():
    with pytest.raises(ValueError, match="needs the name of the model"):
        Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="timeout"):
        Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m", timeout=0)
    with pytest.raises(ValueError, match="max_retries"):
        Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m", max_retries=-1)


def test_without_the_openai_package_a_saved_enhancer_loads_and_its_first_request_names_the_extra(
    monkeypatch, tmp_path
):
    """A repo that saved an endpoint enhancer loads for users who never enhance; asking for a rewrite without the
    package is the error that says which extra to install."""
    monkeypatch.setitem(sys.modules, "openai", None)  # what `import openai` meets where it is not installed
    Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m").save_pretrained(tmp_path / "enhancer")
    loaded = Magi2PromptEnhancer.from_pretrained(tmp_path / "enhancer")
    assert loaded.client.model == "m"
    with pytest.raises(ImportError, match=r"pip install 'diffusers-magi2\[enhance\]'"):
        loaded("a fox")
