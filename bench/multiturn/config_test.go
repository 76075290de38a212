package multiturn

import (
	"errors"
	"strings"
	"testing"
)

const goodConfig = `{
  "filetype": "generate_conversations",
  "num_conversations": 3,
  "text_files": ["no-such-file.txt"],
  "prompt_input": {
    "num_turns": {"distribution": "constant", "value": 4},
    "common_prefix_num_tokens": {"distribution": "constant", "value": 0},
    "prefix_num_tokens": {"distribution": "constant", "value": 10},
    "num_tokens": {"distribution": "constant", "value": 40}
  },
  "prompt_output": {"num_tokens": {"distribution": "constant", "value": 8}}
}`

// edit replaces old with new in goodConfig (which must contain old).
func edit(t *testing.T, old, new string) string {
	t.Helper()
	if !strings.Contains(goodConfig, old) {
		t.Fatalf("goodConfig lacks %q", old)
	}
	return strings.Replace(goodConfig, old, new, 1)
}

func TestParseGenConfigValid(t *testing.T) {
	c, err := ParseGenConfig([]byte(goodConfig))
	if err != nil {
		t.Fatal(err)
	}
	if c.NumConversations != 3 || c.TextFiles[0] != "no-such-file.txt" || c.PrintStats {
		t.Errorf("parsed %+v", c)
	}
	// common_prefix_num_tokens is optional.
	c, err = ParseGenConfig([]byte(edit(t, `"common_prefix_num_tokens": {"distribution": "constant", "value": 0},`, "")))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.CommonPrefixNumTokens.Sample(newRand(1), 1)[0]; got != 0 {
		t.Errorf("absent common prefix = %d, want 0", got)
	}
	if p := c.Params(); p[0][0] != "text_files" || p[1][1] != "Constant[4]" {
		t.Errorf("Params() = %v", p)
	}
}

func TestParseGenConfigErrors(t *testing.T) {
	cases := []struct {
		name, input, want string
	}{
		{"not json", `{`, "invalid input file"},
		{"missing filetype", edit(t, `"filetype": "generate_conversations",`, ""), "filetype: missing required key"},
		{"wrong filetype", edit(t, `"generate_conversations"`, `"sharegpt"`), "filetype: must be"},
		{"zero conversations", edit(t, `"num_conversations": 3`, `"num_conversations": 0`), "num_conversations: must be larger than zero"},
		{"string conversations", edit(t, `"num_conversations": 3`, `"num_conversations": "3"`), "num_conversations: must be an integer"},
		{"empty text files", edit(t, `["no-such-file.txt"]`, `[]`), "text_files: must list at least one file"},
		{"text files not list", edit(t, `["no-such-file.txt"]`, `"a.txt"`), "text_files: must be a list"},
		{"missing prompt_output", edit(t, `"prompt_output": {"num_tokens": {"distribution": "constant", "value": 8}}`, `"x": 1`), "prompt_output: missing required key"},
		{"missing num_turns", edit(t, `"num_turns": {"distribution": "constant", "value": 4},`, ""), "prompt_input.num_turns: missing required key"},
		{"missing prefix", edit(t, `"prefix_num_tokens": {"distribution": "constant", "value": 10},`, ""), "prompt_input.prefix_num_tokens: missing required key"},
		{"missing distribution", edit(t, `"num_tokens": {"distribution": "constant", "value": 40}`, `"num_tokens": {"value": 40}`), `prompt_input.num_tokens: missing key "distribution"`},
		{"unknown distribution", edit(t, `"distribution": "constant", "value": 4`, `"distribution": "gauss", "value": 4`), `prompt_input.num_turns.distribution: unknown distribution "gauss"`},
		{"constant without value", edit(t, `"distribution": "constant", "value": 4`, `"distribution": "constant"`), `prompt_input.num_turns: missing key "value"`},
		{"uniform min zero", edit(t, `"distribution": "constant", "value": 4`, `"distribution": "uniform", "min": 0, "max": 4`), "prompt_input.num_turns.min: must be > 0"},
		{"uniform min > max", edit(t, `"distribution": "constant", "value": 4`, `"distribution": "uniform", "min": 5, "max": 4`), "prompt_input.num_turns: min 5 is larger than max 4"},
		{"uniform no max", edit(t, `"distribution": "constant", "value": 4`, `"distribution": "uniform", "min": 5`), `prompt_input.num_turns: missing key "max"`},
		{"lognormal both forms", edit(t, `"distribution": "constant", "value": 10`, `"distribution": "lognormal", "average": 10, "mean": 1, "sigma": 1`), "prompt_input.prefix_num_tokens: give either"},
		{"lognormal ratio", edit(t, `"distribution": "constant", "value": 10`, `"distribution": "lognormal", "average": 10, "median_ratio": 1.5`), "prompt_input.prefix_num_tokens.median_ratio: must be in (0, 1)"},
		{"lognormal no sigma", edit(t, `"distribution": "constant", "value": 10`, `"distribution": "lognormal", "mean": 1`), `prompt_input.prefix_num_tokens: missing key "sigma"`},
		{"zipf alpha", edit(t, `"distribution": "constant", "value": 8`, `"distribution": "zipf", "alpha": 1`), "prompt_output.num_tokens.alpha: must be > 1"},
		{"poisson no alpha", edit(t, `"distribution": "constant", "value": 8`, `"distribution": "poisson"`), `prompt_output.num_tokens: missing key "alpha"`},
		{"negative max", edit(t, `"distribution": "constant", "value": 8`, `"distribution": "poisson", "alpha": 3, "max": -1`), "prompt_output.num_tokens.max: must not be negative"},
		{"string number", edit(t, `"value": 40`, `"value": "40"`), "prompt_input.num_tokens.value: must be a number"},
		{"print_stats type", edit(t, `"num_conversations": 3,`, `"num_conversations": 3, "print_stats": "yes",`), "print_stats: must be true or false"},
	}
	for _, c := range cases {
		_, err := ParseGenConfig([]byte(c.input))
		if err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v is not ErrConfig", c.name, err)
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %q does not contain %q", c.name, err, c.want)
		}
	}
}

func TestParseShareGPT(t *testing.T) {
	convs, err := ParseShareGPT([]byte(`[
	  {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]},
	  {"id": "b", "messages": [{"role": "user", "content": "x"}], "extra": 1}
	]`))
	if err != nil {
		t.Fatal(err)
	}
	if len(convs) != 2 || convs[0].ID != "a" || len(convs[0].Messages) != 3 || convs[0].Messages[1].Content != "hello" || convs[1].ID != "b" {
		t.Errorf("parsed %+v", convs)
	}
	cases := []struct{ input, want string }{
		{`{"id": "a"}`, "ShareGPT list"},
		{`[]`, "the ShareGPT list is empty"},
		{`[{"messages": []}]`, "[0].id: missing"},
		{`[{"id": 5, "messages": []}]`, "[0].id: must be a string"},
		{`[{"id": "a"}]`, `[0] (id "a").messages: missing`},
		{`[{"id": "a", "messages": []}]`, "conversation with no messages"},
		{`[{"id": "a", "messages": "hi"}]`, "must be a list"},
		{`[{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}]`, `messages[0].role: is "assistant", want "user"`},
		{`[{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}]`, `messages[1].role: is "user", want "assistant"`},
		{`[{"id": "a", "messages": [{"role": "user", "content": "x"}]}, {"id": "a", "messages": [{"role": "user", "content": "y"}]}]`, `[1] (id "a").id: duplicate of item [0]`},
	}
	for _, c := range cases {
		_, err := ParseShareGPT([]byte(c.input))
		if err == nil || !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want ErrConfig containing %q", c.input, err, c.want)
		}
	}
}
