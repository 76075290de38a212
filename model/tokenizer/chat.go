package tokenizer

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ardanlabs/jinja"
)

// Message is one chat message.
type Message struct {
	Role, Content string
}

// ChatTemplate renders a conversation into the prompt text a model was trained on.
// Implementations are safe for concurrent use.
type ChatTemplate interface {
	// Render returns the prompt for msgs (see RenderOptions).
	Render(msgs []Message, opts RenderOptions) (string, error)
}

// RenderOptions are the chat-template arguments of vLLM's chat API.
type RenderOptions struct {
	// AddGenerationPrompt ends the prompt with the opening of an assistant turn.
	AddGenerationPrompt bool
	// ContinueFinalMessage leaves the final message open, so the model continues it: the
	// prompt ends right after that message's content (transformers' continue_final_message).
	// It excludes AddGenerationPrompt.
	ContinueFinalMessage bool
	// Kwargs are extra template variables (vLLM's chat_template_kwargs, e.g. Qwen3's
	// enable_thinking); values are what encoding/json decodes into an any.
	Kwargs map[string]any
}

// ErrBadRenderOptions means RenderOptions that cannot be honoured (both AddGenerationPrompt and
// ContinueFinalMessage, a final message to continue that is missing, a kwarg that would replace
// the messages).
var ErrBadRenderOptions = errors.New("tokenizer: chat template options")

// check validates opts for msgs.
func (opts RenderOptions) check(msgs []Message) error {
	if opts.AddGenerationPrompt && opts.ContinueFinalMessage {
		return fmt.Errorf("%w: cannot set both continue_final_message and add_generation_prompt", ErrBadRenderOptions)
	}
	if opts.ContinueFinalMessage && len(msgs) == 0 {
		return fmt.Errorf("%w: continue_final_message needs a final message", ErrBadRenderOptions)
	}
	for k := range opts.Kwargs {
		if k == "messages" || strings.HasPrefix(k, "__kvbridge") {
			return fmt.Errorf("%w: chat_template_kwargs may not set %q", ErrBadRenderOptions, k)
		}
	}
	return nil
}

// continueFinal cuts rendered after the last occurrence of the final message's content (or,
// for templates that trim messages, of its stripped content), as transformers does for
// continue_final_message.
func continueFinal(rendered string, msgs []Message) (string, error) {
	final := msgs[len(msgs)-1].Content
	for _, c := range []string{final, pyStrip(final)} {
		if i := strings.LastIndex(rendered, c); i >= 0 {
			return rendered[:i+len(c)], nil
		}
	}
	return "", fmt.Errorf("%w: continue_final_message: the template does not render the final message's content", ErrBadRenderOptions)
}

// pythonSpace are the characters Python's str.strip() removes (str.isspace).
const pythonSpace = "\t\n\v\f\r\x1c\x1d\x1e\x1f \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"

// pyStrip is Python's str.strip().
func pyStrip(s string) string { return strings.Trim(s, pythonSpace) }

// ChatML returns the Qwen-style ChatML template: "<|im_start|>{role}\n{content}<|im_end|>\n"
// per message, then "<|im_start|>assistant\n" when addGenerationPrompt. It never fails.
func ChatML() ChatTemplate { return chatML{} }

// chatML is the built-in ChatML template.
type chatML struct{}

// Render renders msgs as ChatML (Kwargs are ignored).
func (chatML) Render(msgs []Message, opts RenderOptions) (string, error) {
	if err := opts.check(msgs); err != nil {
		return "", err
	}
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|im_start|>")
		b.WriteString(m.Role)
		b.WriteByte('\n')
		b.WriteString(m.Content)
		b.WriteString("<|im_end|>\n")
	}
	if opts.AddGenerationPrompt {
		b.WriteString("<|im_start|>assistant\n")
	}
	if opts.ContinueFinalMessage {
		return continueFinal(b.String(), msgs)
	}
	return b.String(), nil
}

// Limits that keep a hostile or broken template from exhausting the process.
const (
	maxMacroDepth = 128     // nested macro calls (recursive macros)
	maxRangeItems = 1 << 20 // items produced by range() in one render
)

// Names of the per-render guards injected into templates, and of the string of the characters
// Python's str.strip() removes, which the whitespace-stripping calls are given.
const (
	guardEnter = "__kvbridge_macro_enter"
	guardLeave = "__kvbridge_macro_leave"
	spaceChars = "__kvbridge_space"
)

// jinjaTemplate is a chat template compiled by github.com/ardanlabs/jinja.
type jinjaTemplate struct {
	tmpl     *jinja.Template
	bos, eos string
}

// ParseChatTemplate compiles a Hugging Face Jinja chat template. Rendering provides messages
// (role, content), add_generation_prompt, bos_token, eos_token, tools (none) and the options'
// Kwargs. Whitespace stripping works as Jinja2's does on Python strings: trim, strip(), lstrip()
// and rstrip() without arguments remove what Python's str.strip() removes. Errors wrap
// ErrChatTemplate; neither compiling nor rendering panics. Macro recursion is limited to 128
// nested calls and range() to about a million items per render.
func ParseChatTemplate(src string, bos, eos string) (ChatTemplate, error) {
	tmpl, err := compileGuarded(src)
	if err != nil {
		return nil, err
	}
	return &jinjaTemplate{tmpl: tmpl, bos: bos, eos: eos}, nil
}

// compileGuarded compiles src with macro guards, turning a compiler panic into an error.
func compileGuarded(src string) (tmpl *jinja.Template, err error) {
	defer func() {
		if r := recover(); r != nil {
			tmpl, err = nil, fmt.Errorf("%w: compile panicked: %v", ErrChatTemplate, r)
		}
	}()
	// Compile the source as written first, so errors point at the user's lines.
	if _, err := jinja.Compile(src); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrChatTemplate, err)
	}
	if tmpl, err = jinja.Compile(pythonStrip(guardMacros(src))); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrChatTemplate, err)
	}
	return tmpl, nil
}

// Render renders msgs with the Jinja template; see ParseChatTemplate for the variables.
func (j *jinjaTemplate) Render(msgs []Message, opts RenderOptions) (out string, err error) {
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("%w: render panicked: %v", ErrChatTemplate, r)
		}
	}()
	if err := opts.check(msgs); err != nil {
		return "", err
	}
	list := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		d := jinja.NewDict()
		d.AsDict().Set("role", jinja.NewString(m.Role))
		d.AsDict().Set("content", jinja.NewString(m.Content))
		list[i] = d
	}
	depth := 0
	rangeLeft := maxRangeItems
	data := make(map[string]jinja.Value, len(opts.Kwargs)+10)
	for k, v := range opts.Kwargs {
		data[k] = jinja.FromGoValue(v)
	}
	for k, v := range map[string]jinja.Value{
		"messages":              jinja.NewList(list),
		"add_generation_prompt": jinja.NewBool(opts.AddGenerationPrompt),
		spaceChars:              jinja.NewString(pythonSpace),
		"bos_token":             jinja.NewString(j.bos),
		"eos_token":             jinja.NewString(j.eos),
		"tools":                 jinja.None(),
		"range": jinja.NewCallable("range", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			return boundedRange(args, &rangeLeft)
		}),
		guardEnter: jinja.NewCallable(guardEnter, func([]jinja.Value, map[string]jinja.Value) (jinja.Value, error) {
			depth++
			if depth > maxMacroDepth {
				return jinja.Undefined(), fmt.Errorf("macro calls nested deeper than %d (unbounded recursion?)", maxMacroDepth)
			}
			return jinja.NewString(""), nil
		}),
		guardLeave: jinja.NewCallable(guardLeave, func([]jinja.Value, map[string]jinja.Value) (jinja.Value, error) {
			depth--
			return jinja.NewString(""), nil
		}),
	} {
		if _, set := opts.Kwargs[k]; !set || k == "messages" || k == "add_generation_prompt" || strings.HasPrefix(k, "__kvbridge") {
			data[k] = v
		}
	}
	out, err = j.tmpl.RenderValues(data)
	if err != nil {
		return "", fmt.Errorf("%w: render: %w", ErrChatTemplate, err)
	}
	if opts.ContinueFinalMessage {
		return continueFinal(out, msgs)
	}
	return out, nil
}

// boundedRange is Jinja's range() that refuses to produce more than *left items in total.
func boundedRange(args []jinja.Value, left *int) (jinja.Value, error) {
	ints := make([]int64, len(args))
	for i, a := range args {
		if !a.IsInt() {
			return jinja.Undefined(), fmt.Errorf("range: argument %d is not an integer", i+1)
		}
		ints[i] = a.AsInt()
	}
	var start, stop, step int64 = 0, 0, 1
	switch len(ints) {
	case 1:
		stop = ints[0]
	case 2:
		start, stop = ints[0], ints[1]
	case 3:
		start, stop, step = ints[0], ints[1], ints[2]
	default:
		return jinja.Undefined(), fmt.Errorf("range: expected 1-3 arguments, got %d", len(args))
	}
	if step == 0 {
		return jinja.Undefined(), fmt.Errorf("range: step must not be zero")
	}
	// Count exactly in unsigned arithmetic (no overflow for any int64 bounds).
	var n uint64
	switch {
	case step > 0 && stop > start:
		n = (uint64(stop)-uint64(start)-1)/uint64(step) + 1
	case step < 0 && stop < start:
		n = (uint64(start)-uint64(stop)-1)/(uint64(-(step+1))+1) + 1
	}
	if n > uint64(*left) {
		return jinja.Undefined(), fmt.Errorf("range: more than %d items", maxRangeItems)
	}
	*left -= int(n)
	items := make([]jinja.Value, n)
	for k := range items {
		items[k] = jinja.NewInt(start + int64(k)*step)
	}
	return jinja.NewList(items), nil
}

// guardMacros inserts a depth guard at the start and end of every macro body, so a recursive
// macro fails with an error instead of overflowing the stack. The guards are expression tags
// that print nothing; Jinja whitespace control (which only looks at neighbouring text) is
// unaffected. The scan mirrors ardanlabs/jinja's scanner; {% raw %} blocks are left alone.
func guardMacros(src string) string {
	var ins []macroGuard
	inRaw := false
	for i := 0; i+1 < len(src); {
		if src[i] != '{' || (src[i+1] != '{' && src[i+1] != '%' && src[i+1] != '#') {
			i++
			continue
		}
		kind := src[i+1]
		contentStart, contentEnd, tagEnd := scanTag(src, i)
		if tagEnd < 0 {
			break // unterminated tag: the compiler reports it
		}
		if kind == '%' {
			kw := strings.TrimSpace(src[contentStart:contentEnd])
			if k := strings.IndexAny(kw, " \t\r\n("); k >= 0 {
				kw = kw[:k]
			}
			switch {
			case inRaw:
				inRaw = kw != "endraw"
			case kw == "raw":
				inRaw = true
			case kw == "macro":
				ins = append(ins, macroGuard{tagEnd, "{{ " + guardEnter + "() }}"})
			case kw == "endmacro":
				ins = append(ins, macroGuard{i, "{{ " + guardLeave + "() }}"})
			}
		}
		i = tagEnd
	}
	if len(ins) == 0 {
		return src
	}
	var b strings.Builder
	prev := 0
	for _, in := range ins {
		b.WriteString(src[prev:in.at])
		b.WriteString(in.text)
		prev = in.at
	}
	b.WriteString(src[prev:])
	return b.String()
}

// macroGuard is a guard tag guardMacros inserts at offset at.
type macroGuard struct {
	at   int
	text string
}

// scanTag scans the tag opening at src[i] ("{{", "{%" or "{#", with an optional "-"): its
// contents are src[contentStart:contentEnd] and it ends before tagEnd, or tagEnd is -1 when it
// is unterminated. Outside comments, string literals are skipped.
func scanTag(src string, i int) (contentStart, contentEnd, tagEnd int) {
	kind := src[i+1]
	closer := "}}"
	switch kind {
	case '%':
		closer = "%}"
	case '#':
		closer = "#}"
	}
	j := i + 2
	if j < len(src) && src[j] == '-' {
		j++
	}
	contentStart = j
	for j < len(src) {
		c := src[j]
		if kind != '#' && (c == '\'' || c == '"') {
			j = skipString(src, j)
			continue
		}
		if c == '-' && j+2 < len(src) && src[j+1] == closer[0] && src[j+2] == closer[1] {
			return contentStart, j, j + 3
		}
		if j+1 < len(src) && c == closer[0] && src[j+1] == closer[1] {
			return contentStart, j, j + 2
		}
		j++
	}
	return contentStart, -1, -1
}

// skipString returns the index just past the string literal opening at src[j] (len(src) when
// it is unterminated); a backslash escapes the next character.
func skipString(src string, j int) int {
	c := src[j]
	j++
	for j < len(src) && src[j] != c {
		if src[j] == '\\' && j+1 < len(src) {
			j++
		}
		j++
	}
	if j < len(src) {
		j++
	}
	return j
}

// pythonStrip gives the argument-less whitespace-stripping calls of a template — the trim filter
// and the strip(), lstrip() and rstrip() methods — the string of the characters Python's
// str.strip() removes, so they strip what Jinja2 strips (the template engine's own defaults
// differ: Go's space set, or only " \t\n\r"). Only tag contents are rewritten, never string
// literals or text; raw blocks are left alone.
func pythonStrip(src string) string {
	var b strings.Builder
	inRaw := false
	i := 0
	for i < len(src) {
		start := strings.Index(src[i:], "{")
		if start < 0 || i+start+1 >= len(src) {
			break
		}
		start += i
		kind := src[start+1]
		if kind != '{' && kind != '%' {
			b.WriteString(src[i : start+1])
			i = start + 1
			continue
		}
		closer := "}}"
		if kind == '%' {
			closer = "%}"
		}
		end := tagEnd(src, start+2, closer)
		if end < 0 {
			break // unterminated: the compiler reports it
		}
		b.WriteString(src[i:start])
		tag := src[start:end]
		if kind == '%' {
			kw := strings.TrimLeft(tag[2:], "- \t\r\n")
			switch {
			case inRaw:
				inRaw = !strings.HasPrefix(kw, "endraw")
			case strings.HasPrefix(kw, "raw"):
				inRaw = true
			}
		}
		if !inRaw {
			tag = rewriteStrips(tag)
		}
		b.WriteString(tag)
		i = end
	}
	b.WriteString(src[i:])
	return b.String()
}

// tagEnd returns the index just past the closer of a tag whose contents start at i, skipping
// string literals, or -1.
func tagEnd(src string, i int, closer string) int {
	for i < len(src) {
		switch c := src[i]; {
		case c == '\'' || c == '"':
			i++
			for i < len(src) && src[i] != c {
				if src[i] == '\\' {
					i++
				}
				i++
			}
			i++
		case strings.HasPrefix(src[i:], closer):
			return i + len(closer)
		default:
			i++
		}
	}
	return -1
}

// rewriteStrips rewrites the argument-less strips of one tag, outside its string literals.
func rewriteStrips(tag string) string {
	var b strings.Builder
	for i := 0; i < len(tag); {
		c := tag[i]
		if c == '\'' || c == '"' {
			j := i + 1
			for j < len(tag) && tag[j] != c {
				if tag[j] == '\\' {
					j++
				}
				j++
			}
			j = min(j+1, len(tag))
			b.WriteString(tag[i:j])
			i = j
			continue
		}
		rest := tag[i:]
		matched := false
		for _, m := range []string{".strip()", ".lstrip()", ".rstrip()"} {
			if strings.HasPrefix(rest, m) {
				b.WriteString(m[:len(m)-1] + spaceChars + ")")
				i += len(m)
				matched = true
				break
			}
		}
		if matched {
			continue
		}
		if c == '|' {
			j := i + 1
			for j < len(tag) && (tag[j] == ' ' || tag[j] == '\t') {
				j++
			}
			if strings.HasPrefix(tag[j:], "trim") {
				k := j + len("trim")
				if k == len(tag) || !(isIdent(tag[k]) || tag[k] == '(') {
					b.WriteString(tag[i:k] + "(" + spaceChars + ")")
					i = k
					continue
				}
			}
		}
		b.WriteByte(c)
		i++
	}
	return b.String()
}

// isIdent reports whether c can continue a Jinja identifier.
func isIdent(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}
