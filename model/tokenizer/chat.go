package tokenizer

import (
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
	// Render returns the prompt for msgs; with addGenerationPrompt it ends with the opening of
	// an assistant turn.
	Render(msgs []Message, addGenerationPrompt bool) (string, error)
}

// ChatML returns the Qwen-style ChatML template: "<|im_start|>{role}\n{content}<|im_end|>\n"
// per message, then "<|im_start|>assistant\n" when addGenerationPrompt. It never fails.
func ChatML() ChatTemplate { return chatML{} }

// chatML is the built-in ChatML template.
type chatML struct{}

// Render renders msgs as ChatML; it never fails.
func (chatML) Render(msgs []Message, addGenerationPrompt bool) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|im_start|>")
		b.WriteString(m.Role)
		b.WriteByte('\n')
		b.WriteString(m.Content)
		b.WriteString("<|im_end|>\n")
	}
	if addGenerationPrompt {
		b.WriteString("<|im_start|>assistant\n")
	}
	return b.String(), nil
}

// Limits that keep a hostile or broken template from exhausting the process.
const (
	maxMacroDepth = 128     // nested macro calls (recursive macros)
	maxRangeItems = 1 << 20 // items produced by range() in one render
)

// Names of the per-render guards injected into templates.
const (
	guardEnter = "__kvbridge_macro_enter"
	guardLeave = "__kvbridge_macro_leave"
)

// jinjaTemplate is a chat template compiled by github.com/ardanlabs/jinja.
type jinjaTemplate struct {
	tmpl     *jinja.Template
	bos, eos string
}

// ParseChatTemplate compiles a Hugging Face Jinja chat template. Rendering provides messages
// (role, content), add_generation_prompt, bos_token, eos_token and tools (none). Errors wrap
// ErrChatTemplate; neither compiling nor rendering panics. Macro recursion is limited to
// 128 nested calls and range() to about a million items per render.
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
	if tmpl, err = jinja.Compile(guardMacros(src)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrChatTemplate, err)
	}
	return tmpl, nil
}

// Render renders msgs with the Jinja template; see ParseChatTemplate for the variables.
func (j *jinjaTemplate) Render(msgs []Message, addGenerationPrompt bool) (out string, err error) {
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("%w: render panicked: %v", ErrChatTemplate, r)
		}
	}()
	list := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		d := jinja.NewDict()
		d.AsDict().Set("role", jinja.NewString(m.Role))
		d.AsDict().Set("content", jinja.NewString(m.Content))
		list[i] = d
	}
	depth := 0
	rangeLeft := maxRangeItems
	data := map[string]jinja.Value{
		"messages":              jinja.NewList(list),
		"add_generation_prompt": jinja.NewBool(addGenerationPrompt),
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
	}
	out, err = j.tmpl.RenderValues(data)
	if err != nil {
		return "", fmt.Errorf("%w: render: %w", ErrChatTemplate, err)
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
	type insertion struct {
		at   int
		text string
	}
	var ins []insertion
	inRaw := false
	for i := 0; i+1 < len(src); {
		if src[i] != '{' || (src[i+1] != '{' && src[i+1] != '%' && src[i+1] != '#') {
			i++
			continue
		}
		kind := src[i+1]
		closer := "}}"
		switch kind {
		case '%':
			closer = "%}"
		case '#':
			closer = "#}"
		}
		tagStart := i
		j := i + 2
		if j < len(src) && src[j] == '-' {
			j++
		}
		contentStart := j
		contentEnd, tagEnd := -1, -1
		for j < len(src) {
			c := src[j]
			if kind != '#' && (c == '\'' || c == '"') {
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
				continue
			}
			if c == '-' && j+2 < len(src) && src[j+1] == closer[0] && src[j+2] == closer[1] {
				contentEnd, tagEnd = j, j+3
				break
			}
			if j+1 < len(src) && c == closer[0] && src[j+1] == closer[1] {
				contentEnd, tagEnd = j, j+2
				break
			}
			j++
		}
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
				ins = append(ins, insertion{tagEnd, "{{ " + guardEnter + "() }}"})
			case kw == "endmacro":
				ins = append(ins, insertion{tagStart, "{{ " + guardLeave + "() }}"})
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
