"""Images in chat messages over HTTP, on a real LLaVA-1.5 stack (worker, scheduler, gateway processes): OpenAI's
image_url parts as data: URLs, http(s) URLs the gateway fetches (from a server the test starts) and file: URLs
under --allowed-local-media-path; greedy tokens equal transformers' on the same pixels; and every bad image gets a
400 naming its field while the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest

from tests import patient_http as httpx
from tests.gateway.shared_stack import error_of, wait_blocks_free
from tests.images import chat_text, hf_greedy_with_images, picture
from tests.oracle import assert_greedy_equal
from tests.services_harness import Stack


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


class ImageServer:
    """http://127.0.0.1:<port>/<name>.png serves the given images (and /page.html a page: not an image)."""

    def __init__(self, images: dict[str, bytes]):
        files = {**{f"/{name}.png": (data, "image/png") for name, data in images.items()},
                 "/page.html": (b"<html></html>", "text/html")}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                data, kind = files.get(self.path, (None, None))
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def images_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "local.png").write_bytes(png_bytes(picture(11)))
    (folder / "notes.txt").write_bytes(b"not an image")
    return folder


@pytest.fixture(scope="module")
def llava_stack(llava_dir, images_folder, tmp_path_factory):
    args = ("--allowed-local-media-path", str(images_folder), "--limit-mm-per-prompt", '{"image": 2}',
            "--max-image-bytes", "200000", "--allowed-media-domains", "127.0.0.1", "--allowed-media-domains",
            "localhost")
    with Stack(llava_dir, tmp_path_factory.mktemp("llava-stack"), worker_args=("--block-size", "4"),
               gateway_args=args) as stack:
        yield stack


@pytest.fixture(scope="module")
def image_server():
    server = ImageServer({"fetched": png_bytes(picture(12))})
    yield server
    server.close()


def chat(stack, parts: list, max_tokens: int = 8) -> httpx.Response:
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": parts}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)


def expect_transformers(llava_dir, reply, images: list, question: str):
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["choices"][0]["token_ids"]
    text = chat_text(str(llava_dir), question, len(images))
    assert_greedy_equal(tokens, *hf_greedy_with_images(llava_dir, text, images, 8), what=question)


def test_qwen2_vl_takes_images_of_any_size_in_chat(qwen2_vl_dir, tmp_path_factory):
    """Qwen2-VL over HTTP: its images resized to grids of their own sizes, each part the vision-start, placeholder
    and vision-end text its chat template writes, M-RoPE positions on the worker."""
    question = "Which is wider?"
    images = [picture(30, (60, 30)), picture(31, (70, 100))]
    with Stack(qwen2_vl_dir, tmp_path_factory.mktemp("qwen2-vl-stack"), worker_args=("--block-size", "4")) as stack:
        parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
        reply = chat(stack, parts + [{"type": "text", "text": question}])
        assert reply.status_code == 200, reply.text
        text = chat_text(str(qwen2_vl_dir), question, 2, "<|vision_start|><|image_pad|><|vision_end|>")
        assert_greedy_equal(reply.json()["choices"][0]["token_ids"],
                            *hf_greedy_with_images(qwen2_vl_dir, text, images, 8), what=question)
        wait_blocks_free(stack)


def test_image_urls_of_each_kind_give_transformers_tokens(llava_stack, llava_dir, image_server, images_folder):
    question = "What do you see?"
    cases = [([picture(10)], [data_url(picture(10))]),
             ([picture(12)], [f"{image_server.base}/fetched.png"]),
             ([picture(11)], [f"file://{images_folder}/local.png"]),
             ([picture(10), picture(12)], [data_url(picture(10)), f"{image_server.base}/fetched.png"])]
    for images, urls in cases:
        parts = [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls]
        expect_transformers(llava_dir, chat(llava_stack, parts + [{"type": "text", "text": question}]), images,
                            question)
    wait_blocks_free(llava_stack)


@pytest.mark.parametrize("part, where, says", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "content[0]",
     "not an image"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "content[0]", "data URL of an image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "content[0]", "allowed media"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "content[0]", "outside"),
    ({"type": "image_url", "image_url": {"url": "ftp://127.0.0.1/x.png"}}, "content[0]", "scheme"),
    ({"type": "image_url", "image_url": {"url": "{server}/page.html"}}, "content[0]", "not an image"),
    ({"type": "image_url", "image_url": {"url": "{server}/missing.png"}}, "content[0]", "could not be fetched"),
    ({"type": "image_url", "image_url": {"url": "{folder}/notes.txt"}}, "content[0]", "not an image"),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "huge"}}, "content[0]", "detail"),
    ({"type": "image_url", "image_url": {"url": data_url(picture(13, (900, 900)))}}, "content[0]", "over the limit"),
])
def test_a_bad_image_gets_a_400_naming_its_part(llava_stack, image_server, images_folder, part, where, says):
    url = part["image_url"]["url"].replace("{server}", image_server.base).replace("{folder}", f"file://{images_folder}")
    part = {**part, "image_url": {**part["image_url"], "url": url}}
    error = error_of(chat(llava_stack, [part, {"type": "text", "text": "and?"}]), 400)
    assert error["param"] == f"messages[0].{where}" and says in error["message"], error
    assert chat(llava_stack, [{"type": "text", "text": "still serving?"}]).status_code == 200


def test_more_images_than_the_limit_are_refused(llava_stack):
    parts = [{"type": "image_url", "image_url": {"url": data_url(picture(14))}}] * 3
    error = error_of(chat(llava_stack, parts + [{"type": "text", "text": "three?"}]), 400)
    assert "at most 2" in error["message"] and error["param"] == "messages"


def test_an_image_sent_to_a_text_model_is_refused(stack):
    body = {"model": stack.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture(15))}}, {"type": "text", "text": "hi"}]}]}
    error = error_of(httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60), 400)
    assert error["param"] == "messages[0].content[0]" and "takes no images" in error["message"]


def test_the_responses_api_takes_input_image_parts(llava_stack, llava_dir):
    from transformers import AutoTokenizer

    question = "What do you see?"
    body = {"model": llava_stack.model_name, "temperature": 0, "max_output_tokens": 8, "ignore_eos": True,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture(16))},
                                                   {"type": "input_text", "text": question}]}]}
    reply = httpx.post(f"{llava_stack.base_url}/v1/responses", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = reply.json()["output"][-1]["content"][0]["text"]
    expected, _ = hf_greedy_with_images(llava_dir, chat_text(str(llava_dir), question, 1), [picture(16)], 8)
    assert answer == AutoTokenizer.from_pretrained(str(llava_dir)).decode(expected)
    bad = {**body, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}
    assert "file_id" in error_of(httpx.post(f"{llava_stack.base_url}/v1/responses", json=bad, timeout=60),
                                 400)["message"]


def test_the_public_grpc_api_takes_images(llava_stack, llava_dir, image_server):
    import grpc

    from shared.proto import pagedserve_api_pb2 as api
    from shared.proto import pagedserve_api_pb2_grpc as api_grpc

    text = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    params = api.SamplingParameters(temperature=0, max_tokens=8, ignore_eos=True)
    with grpc.insecure_channel(f"127.0.0.1:{llava_stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        for image, source in ((picture(19), {"data": png_bytes(picture(19))}),
                              (picture(12), {"url": f"{image_server.base}/fetched.png"})):
            request = api.GenerateRequest(text=text, params=params, images=[api.Image(**source)])
            tokens = [t for reply in stub.Generate(request, timeout=120) for t in reply.token_ids]
            assert_greedy_equal(tokens, *hf_greedy_with_images(llava_dir, text, [image], 8), what=str(list(source)))
        bad = api.GenerateRequest(text=text, params=params, images=[api.Image(data=b"not an image")])
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(bad, timeout=60))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "images[0]" in error.value.details()


def test_redirects_are_not_followed_and_huge_images_are_refused_before_decoding(llava_stack):
    """A redirect could lead outside the allowed domains; a small file may hold a huge image."""
    import http.server as server_module

    class Redirect(server_module.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.1/internal.png")
            self.end_headers()

        def log_message(self, *args):
            pass

    redirect = server_module.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=redirect.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{redirect.server_address[1]}/cat.png"
        error = error_of(chat(llava_stack, [{"type": "image_url", "image_url": {"url": url}}]), 400)
        assert "redirects are not followed" in error["message"] and error["param"] == "messages[0].content[0]"
    finally:
        redirect.shutdown()
        redirect.server_close()
    from PIL import Image

    huge = io.BytesIO()
    Image.new("1", (8000, 8000)).save(huge, format="PNG")  # a few kilobytes, 64 M pixels
    url = "data:image/png;base64," + base64.b64encode(huge.getvalue()).decode()
    error = error_of(chat(llava_stack, [{"type": "image_url", "image_url": {"url": url}}]), 400)
    assert "pixels, over the limit" in error["message"]
