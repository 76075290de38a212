package tokenizer

import (
	"errors"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/ardanlabs/jinja"
)

// llama3Template is Meta-Llama-3-8B-Instruct's chat_template.
const llama3Template = `{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>

'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>

' }}{% endif %}`

// readTemplate reads a chat template from testdata.
func readTemplate(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// mustRender renders msgs or fails the test.
func mustRender(t *testing.T, ct ChatTemplate, msgs []Message, gen bool) string {
	t.Helper()
	out, err := ct.Render(msgs, RenderOptions{AddGenerationPrompt: gen})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestChatML(t *testing.T) {
	msgs := []Message{{"system", "You are helpful."}, {"user", "Hi 世界"}, {"assistant", "Hello!"}, {"user", "Bye"}}
	want := "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi 世界<|im_end|>\n" +
		"<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
	if got := mustRender(t, ChatML(), msgs, false); got != want {
		t.Errorf("ChatML = %q", got)
	}
	if got := mustRender(t, ChatML(), msgs, true); got != want+"<|im_start|>assistant\n" {
		t.Errorf("ChatML with generation prompt = %q", got)
	}
	if got := mustRender(t, ChatML(), nil, true); got != "<|im_start|>assistant\n" {
		t.Errorf("ChatML(no messages) = %q", got)
	}
}

func TestQwen3Template(t *testing.T) {
	ct, err := ParseChatTemplate(readTemplate(t, "qwen3_chat_template.jinja"), "", "<|im_end|>")
	if err != nil {
		t.Fatal(err)
	}
	// Plain conversations render exactly as the built-in ChatML.
	for _, msgs := range [][]Message{
		{{"user", "Hi"}},
		{{"system", "You are helpful."}, {"user", "Hi"}},
		{{"system", "S"}, {"user", "a"}, {"assistant", "b"}, {"user", "c"}},
	} {
		for _, gen := range []bool{false, true} {
			got := mustRender(t, ct, msgs, gen)
			if want := mustRender(t, ChatML(), msgs, gen); got != want {
				t.Errorf("Qwen3 template %v gen=%v:\n got %q\nwant %q", msgs, gen, got, want)
			}
		}
	}
	// Reasoning of earlier assistant turns is dropped; the final turn keeps it.
	got := mustRender(t, ct, []Message{
		{"user", "What is 2+2?"}, {"assistant", "<think>\nadd\n</think>\n\n4"}, {"user", "And 3+3?"},
	}, true)
	want := "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n" +
		"<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
	if got != want {
		t.Errorf("multi-turn reasoning:\n got %q\nwant %q", got, want)
	}
	got = mustRender(t, ct, []Message{{"user", "q"}, {"assistant", "<think>\nr\n</think>\n\na"}}, false)
	if want := "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\na<|im_end|>\n"; got != want {
		t.Errorf("final-turn reasoning:\n got %q\nwant %q", got, want)
	}
	// The rendered prompt tokenizes with its special tokens recognised.
	tok := Builtin(4096)
	ids := tok.Encode(got)
	if ids[0] != 4094 || tok.Decode(ids) != got {
		t.Errorf("prompt tokens start %v", ids[:3])
	}
}

func TestLlama3Templates(t *testing.T) {
	ct, err := ParseChatTemplate(llama3Template, "<|begin_of_text|>", "<|eot_id|>")
	if err != nil {
		t.Fatal(err)
	}
	got := mustRender(t, ct, []Message{{"system", "S"}, {"user", "  U \n"}}, true)
	want := "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>" +
		"<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
	if got != want {
		t.Errorf("Llama 3:\n got %q\nwant %q", got, want)
	}
}

func TestChatTemplateErrors(t *testing.T) {
	compileErrors := []string{"{% if %}", "{{ messages", "{% for m in messages %}", "{% endif %}"}
	for _, src := range compileErrors {
		if _, err := ParseChatTemplate(src, "", ""); !errors.Is(err, ErrChatTemplate) {
			t.Errorf("ParseChatTemplate(%q) err = %v", src, err)
		}
	}
	renderErrors := map[string]string{
		`{{ raise_exception("no system message allowed") }}`:                                    "no system message allowed",
		`{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}`:                                    "nested deeper",
		`{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}`: "nested deeper",
		`{% for i in range(100000000000) %}x{% endfor %}`:                                       "range",
		`{% set a = range(600000) %}{% set b = range(600000) %}`:                                "range", // budget is per render
	}
	for src, want := range renderErrors {
		ct, err := ParseChatTemplate(src, "", "")
		if err != nil {
			t.Errorf("ParseChatTemplate(%q): %v", src, err)
			continue
		}
		_, err = ct.Render([]Message{{"user", "hi"}}, RenderOptions{AddGenerationPrompt: true})
		if !errors.Is(err, ErrChatTemplate) || !strings.Contains(err.Error(), want) {
			t.Errorf("Render(%q) err = %v, want one mentioning %q", src, err, want)
		}
	}
	// Indexing an empty message list must not panic (an error or output are both fine).
	ct, err := ParseChatTemplate(`{{ messages[0].role }}{{ messages[-1]['content'] }}`, "", "")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = ct.Render(nil, RenderOptions{AddGenerationPrompt: true})
}

func TestChatTemplateBoundedRecursionAndRange(t *testing.T) {
	src := `{% macro countdown(n) %}{% if n > 0 %}{{ n }}{{ countdown(n - 1) }}{% endif %}{% endmacro %}` +
		`{{ countdown(5) }}|{% for i in range(3) %}{{ i }}{% endfor %}|{% for i in range(10, 0, -4) %}{{ i }},{% endfor %}`
	ct, err := ParseChatTemplate(src, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRender(t, ct, nil, false); got != "54321|012|10,6,2," {
		t.Errorf("rendered %q", got)
	}
}

func TestChatTemplateGuardKeepsWhitespace(t *testing.T) {
	// The macro guards must not change output: compare with the library rendering the source
	// as written, for a template that leans on every whitespace rule around macro tags.
	src := "{%- macro line(role, text) -%}\n  <|im_start|>{{ role }}\n{{ text }}<|im_end|>\n  {%- endmacro %}\n" +
		"{% macro plain(x) %}\n    [{{ x }}]\n{% endmacro %}\n" +
		"{%- for m in messages %}\n    {{ line(m.role, m.content) }}\n    {{- plain(m.role) }}\n{%- endfor %}\n" +
		"{% raw %}{% macro not_a_macro() %}{% endraw %}\n{{ bos_token }}{{ eos_token }}"
	ct, err := ParseChatTemplate(src, "<s>", "</s>")
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{"user", "hi"}, {"assistant", "yo"}}
	got := mustRender(t, ct, msgs, false)
	ref, err := jinja.Compile(src)
	if err != nil {
		t.Fatal(err)
	}
	want, err := ref.Render(map[string]any{
		"messages": []any{
			map[string]any{"role": "user", "content": "hi"},
			map[string]any{"role": "assistant", "content": "yo"},
		},
		"add_generation_prompt": false, "bos_token": "<s>", "eos_token": "</s>", "tools": nil,
	})
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("guarded render differs:\n got %q\nwant %q", got, want)
	}
}

func TestChatTemplateConcurrentRender(t *testing.T) {
	ct, err := ParseChatTemplate(`{% macro m(x) %}<{{ x }}>{% endmacro %}{% for msg in messages %}{{ m(msg.content) }}{% endfor %}`, "", "")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Go(func() {
			msgs := []Message{{"user", strings.Repeat("x", i)}}
			for range 50 {
				out, err := ct.Render(msgs, RenderOptions{})
				if err != nil || out != "<"+strings.Repeat("x", i)+">" {
					errs <- errors.Join(err, errors.New(out))
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestQwen3ChatTemplateOptions renders Qwen3's real chat template with vLLM's chat options; the
// expected prompts are read off the template's source (testdata/qwen3_chat_template.jinja).
func TestQwen3ChatTemplateOptions(t *testing.T) {
	ct, err := ParseChatTemplate(readTemplate(t, "qwen3_chat_template.jinja"), "", "<|im_end|>")
	if err != nil {
		t.Fatal(err)
	}
	user := []Message{{Role: "user", Content: "Hi"}}
	render := func(msgs []Message, opts RenderOptions) string {
		t.Helper()
		out, err := ct.Render(msgs, opts)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if got, want := render(user, RenderOptions{AddGenerationPrompt: true, Kwargs: map[string]any{"enable_thinking": false}}),
		"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"; got != want {
		t.Errorf("enable_thinking false: %q, want %q", got, want)
	}
	for _, kw := range []map[string]any{nil, {"enable_thinking": true}} {
		if got, want := render(user, RenderOptions{AddGenerationPrompt: true, Kwargs: kw}), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"; got != want {
			t.Errorf("kwargs %v: %q, want %q", kw, got, want)
		}
	}
	// continue_final_message: the prompt stops inside the assistant's last message.
	partial := append(user, Message{Role: "assistant", Content: "The answer is"})
	if got, want := render(partial, RenderOptions{ContinueFinalMessage: true}),
		"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is"; got != want {
		t.Errorf("continue_final_message: %q, want %q", got, want)
	}
	if got, want := render(partial, RenderOptions{}), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is<|im_end|>\n"; got != want {
		t.Errorf("closed final message: %q, want %q", got, want)
	}
	for name, opts := range map[string]RenderOptions{
		"both":            {AddGenerationPrompt: true, ContinueFinalMessage: true},
		"kwarg messages":  {Kwargs: map[string]any{"messages": []any{}}},
		"kwarg internals": {Kwargs: map[string]any{spaceChars: "x"}},
	} {
		for _, tmpl := range []ChatTemplate{ct, ChatML()} {
			if _, err := tmpl.Render(partial, opts); !errors.Is(err, ErrBadRenderOptions) {
				t.Errorf("%s: err = %v, want ErrBadRenderOptions", name, err)
			}
		}
	}
	if _, err := ChatML().Render(nil, RenderOptions{ContinueFinalMessage: true}); !errors.Is(err, ErrBadRenderOptions) {
		t.Errorf("continue with no messages: err = %v", err)
	}
	if got, _ := ChatML().Render(partial, RenderOptions{ContinueFinalMessage: true}); got != "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is" {
		t.Errorf("ChatML continue_final_message: %q", got)
	}
}

// TestChatTemplateStripsLikePython: trim and argument-less strip(), lstrip() and rstrip()
// remove what Python's str.strip() removes (str.isspace: including \x1c–\x1f, \v, U+00A0 and
// U+3000), as Jinja2 does; string literals in tags are not rewritten.
func TestChatTemplateStripsLikePython(t *testing.T) {
	ct, err := ParseChatTemplate(`{{ messages[0].content|trim }}|{{ messages[0].content.strip() }}|{{ messages[0].content.lstrip() }}|`+
		`{{ messages[0].content.rstrip() }}|{{ 'xhix'|trim('x') }}|{{ '.strip() |trim' }}{% raw %}{{ a|trim }}{% endraw %}`, "", "")
	if err != nil {
		t.Fatal(err)
	}
	x := "\x1c\v\u3000 hi \u00a0\x1f\n"
	got, err := ct.Render([]Message{{Role: "user", Content: x}}, RenderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Python: x.strip() == 'hi', x.lstrip() == 'hi \xa0\x1f\n', x.rstrip() == '\x1c\x0b\u3000 hi'.
	if want := "hi|hi|hi \u00a0\x1f\n|\x1c\v\u3000 hi|hi|.strip() |trim{{ a|trim }}"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
}
