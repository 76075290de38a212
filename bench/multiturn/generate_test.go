package multiturn

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// tinyCounter is the token counter of kvbridge/tiny (a real BPE tokenizer).
func tinyCounter(t *testing.T) *TokenCounter {
	t.Helper()
	tc := OpenTokenCounter(t.Context(), "kvbridge/tiny")
	if tc.Estimated() {
		t.Fatalf("kvbridge/tiny tokenizer not loaded: %s", tc)
	}
	return tc
}

func genConfig(t *testing.T, js string) *GenConfig {
	t.Helper()
	c, err := ParseGenConfig([]byte(js))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestGenerateTurnsAndTokenCounts(t *testing.T) {
	for _, tc := range []*TokenCounter{tinyCounter(t), EstimateTokenCounter("test")} {
		t.Run(tc.String(), func(t *testing.T) {
			cfg := genConfig(t, `{
			  "filetype": "generate_conversations", "num_conversations": 12, "text_files": ["x"],
			  "prompt_input": {
			    "num_turns": {"distribution": "uniform", "min": 1, "max": 9},
			    "common_prefix_num_tokens": {"distribution": "constant", "value": 50},
			    "prefix_num_tokens": {"distribution": "constant", "value": 30},
			    "num_tokens": {"distribution": "constant", "value": 120}
			  },
			  "prompt_output": {"num_tokens": {"distribution": "constant", "value": 25}}
			}`)
			g, err := Generate(cfg, DefaultText(), tc, 42)
			if err != nil {
				t.Fatal(err)
			}
			if len(g.Conversations) != 12 || g.Wrapped {
				t.Fatalf("%d conversations, wrapped %v", len(g.Conversations), g.Wrapped)
			}
			var common string
			for i, c := range g.Conversations {
				if c.ID != fmt.Sprintf("CONV_ID_%d", i) {
					t.Errorf("id %q", c.ID)
				}
				n := len(c.Messages)
				if n < 2 || n%2 != 0 || n > 10 {
					t.Errorf("%s: %d messages, want even in [2, 10]", c.ID, n)
				}
				for j, m := range c.Messages {
					want := "user"
					if j%2 == 1 {
						want = "assistant"
					}
					if m.Role != want {
						t.Fatalf("%s message %d role %q", c.ID, j, m.Role)
					}
					got := tc.Count(m.Content)
					switch {
					case j%2 == 1:
						if got < 23 || got > 27 {
							t.Errorf("%s answer %d: %d tokens, want ≈25", c.ID, j, got)
						}
					case j == 0:
						nice := fmt.Sprintf("%d is a nice number... %d, ", i, i)
						k := strings.Index(m.Content, nice)
						if k <= 0 || !strings.Contains(m.Content, BasePrompt) {
							t.Fatalf("%s first message lacks the common prefix, %q or the instruction: %q", c.ID, nice, m.Content[:min(200, len(m.Content))])
						}
						if common == "" {
							common = m.Content[:k]
						} else if m.Content[:k] != common {
							t.Errorf("%s: common prefix differs", c.ID)
						}
						// Common prefix and the "nice number" line count towards num_tokens, the
						// conversation prefix (30) comes on top.
						if got < 140 || got > 160 {
							t.Errorf("%s first message: %d tokens, want ≈150", c.ID, got)
						}
					default:
						if !strings.HasPrefix(m.Content, fmt.Sprintf("%d is a nice number... %s", i, BasePrompt)) {
							t.Errorf("%s message %d: %q", c.ID, j, m.Content[:60])
						}
						if got < 114 || got > 126 {
							t.Errorf("%s message %d: %d tokens, want ≈120", c.ID, j, got)
						}
					}
				}
			}
			if tc.Count(common) < 45 || tc.Count(common) > 55 || !strings.HasSuffix(common, ".") {
				t.Errorf("common prefix %d tokens: %q", tc.Count(common), common)
			}
			// Same seed, same conversations; another seed, others.
			g2, _ := Generate(cfg, DefaultText(), tc, 42)
			g3, _ := Generate(cfg, DefaultText(), tc, 43)
			if fmt.Sprint(g2.Conversations) != fmt.Sprint(g.Conversations) {
				t.Error("same seed generated different conversations")
			}
			if fmt.Sprint(g3.Conversations) == fmt.Sprint(g.Conversations) {
				t.Error("different seeds generated the same conversations")
			}
		})
	}
}

func TestGenerateWrapsShortText(t *testing.T) {
	cfg := genConfig(t, goodConfig)
	g, err := Generate(cfg, "A short text. It has few tokens.", tinyCounter(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !g.Wrapped {
		t.Error("short text did not wrap")
	}
	if _, err := Generate(cfg, "", tinyCounter(t), 1); err == nil {
		t.Error("empty text: no error")
	}
	huge := genConfig(t, strings.Replace(goodConfig, `"distribution": "constant", "value": 40`, `"distribution": "constant", "value": 100000000`, 1))
	if _, err := Generate(huge, DefaultText(), EstimateTokenCounter(""), 1); err == nil || !strings.Contains(err.Error(), "prompt_input.num_tokens") {
		t.Errorf("huge draw: %v", err)
	}
}

func TestReadInput(t *testing.T) {
	dir := t.TempDir()
	tc := EstimateTokenCounter("test")
	// A missing text file falls back to the embedded text with a notice.
	cfgPath := filepath.Join(dir, "gen.json")
	os.WriteFile(cfgPath, []byte(goodConfig), 0o644)
	in, err := ReadInput(cfgPath, tc, 0)
	if err != nil {
		t.Fatal(err)
	}
	if in.Gen == nil || len(in.Conversations) != 3 || len(in.Notices) != 1 || !strings.Contains(in.Notices[0], "no-such-file.txt") {
		t.Fatalf("input %+v", in)
	}
	// A text file next to the config is used (relative to the config, not the working dir).
	os.WriteFile(filepath.Join(dir, "mine.txt"), []byte(strings.Repeat("Zebras graze quietly near the river bank. ", 400)), 0o644)
	os.WriteFile(cfgPath, []byte(strings.Replace(goodConfig, "no-such-file.txt", "mine.txt", 1)), 0o644)
	in, err = ReadInput(cfgPath, tc, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(in.Notices) != 0 || !strings.Contains(in.Conversations[0].Messages[0].Content, "Zebras") {
		t.Errorf("notices %v, first message %q", in.Notices, in.Conversations[0].Messages[0].Content)
	}
	// ShareGPT.
	sgPath := filepath.Join(dir, "sg.json")
	os.WriteFile(sgPath, []byte(` [{"id": "x", "messages": [{"role": "user", "content": "hi"}]}]`), 0o644)
	in, err = ReadInput(sgPath, tc, 0)
	if err != nil || in.Gen != nil || len(in.Conversations) != 1 {
		t.Errorf("sharegpt: %+v %v", in, err)
	}
	// Neither.
	os.WriteFile(sgPath, []byte(`42`), 0o644)
	if _, err := ReadInput(sgPath, tc, 0); err == nil {
		t.Error("number input: no error")
	}
}

func TestSampleConfigParses(t *testing.T) {
	in, err := ReadInput("generate_multi_turn.json", EstimateTokenCounter("test"), 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(in.Notices) != 0 {
		t.Errorf("sample config notices: %v", in.Notices)
	}
}
