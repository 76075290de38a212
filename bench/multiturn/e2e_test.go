package multiturn

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/instance"
)

// TestRunAgainstEngine runs the benchmark against a real kvbridge engine (kvbridge/tiny on
// loopback): 2 clients × 3 short conversations, streaming and not, and checks that every request
// succeeded and that the report, the JSON files and the chart are well formed.
func TestRunAgainstEngine(t *testing.T) {
	ctx := t.Context()
	in, err := instance.Start(ctx, instance.Config{Model: "kvbridge/tiny", Host: "127.0.0.1", NumBlocks: 512, MaxModelLen: 4096, PrefixCaching: true})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()

	tc := OpenTokenCounter(ctx, "kvbridge/tiny")
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "gen.json")
	if err := os.WriteFile(cfgPath, []byte(goodConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	input, err := ReadInput(cfgPath, tc, 0)
	if err != nil {
		t.Fatal(err)
	}
	if lines := ServerInfo(ctx, nil, in.URL, nil); len(lines) == 0 || !strings.Contains(strings.Join(lines, "\n"), "kvbridge/tiny") {
		t.Errorf("server info: %v", lines)
	}

	for _, stream := range []bool{true, false} {
		name := "stream"
		if !stream {
			name = "no-stream"
		}
		t.Run(name, func(t *testing.T) {
			var progress bytes.Buffer
			opts := Options{
				URL: in.URL + "/", Model: "kvbridge/tiny", Tokens: tc, NumClients: 2,
				NoEarlyStop: true, NoStream: !stream, SendConversationID: true, Progress: &progress,
			}
			res, err := Run(ctx, input.Conversations, opts)
			if err != nil {
				t.Fatalf("run: %v\n%s", err, progress.String())
			}
			// 3 conversations of 4 messages: 2 user turns each.
			if res.Failures != 0 || len(res.Samples) != 6 || len(res.Conversations) != 3 {
				t.Fatalf("failures %d, samples %d, finished %d\n%s", res.Failures, len(res.Samples), len(res.Conversations), progress.String())
			}
			seen := map[string]int{}
			for _, s := range res.Samples {
				seen[s.ConversationID]++
				if s.OutputNumTokens < 1 || s.LatencyMs <= 0 || s.TTFTMs <= 0 || s.InputNumTokens <= 0 || (s.InputNumTurns != 1 && s.InputNumTurns != 3) {
					t.Errorf("sample %+v", s)
				}
				if s.InputNumTurns == 3 && s.ApproxCachedPercent <= 0 {
					t.Errorf("second turn without history: %+v", s)
				}
				if !stream && s.OutputNumChunks != 0 {
					t.Errorf("non-stream sample with chunks: %+v", s)
				}
			}
			if len(seen) != 3 {
				t.Errorf("conversations measured: %v", seen)
			}
			// The server's answers replaced the dataset's placeholders.
			for _, c := range res.Conversations {
				if len(c.Messages) != 4 {
					t.Fatalf("%s: %d messages", c.ID, len(c.Messages))
				}
				for i, orig := range input.Conversations {
					if orig.ID == c.ID && c.Messages[1].Content == input.Conversations[i].Messages[1].Content {
						t.Errorf("%s: answer not replaced", c.ID)
					}
				}
			}

			sum := Summarize(res, ReportInfo{Model: "kvbridge/tiny", Options: opts, Input: input})
			var report bytes.Buffer
			if err := WriteReport(&report, sum); err != nil {
				t.Fatal(err)
			}
			for _, want := range []string{"Parameters:", "Conversations Generation Parameters:", "Statistics summary:", "requests_per_sec = ", "ttft_ms", "output_num_chunks", "tokenizer of kvbridge/tiny"} {
				if !strings.Contains(report.String(), want) {
					t.Errorf("report lacks %q:\n%s", want, report.String())
				}
			}
			if len(sum.TTFTMsByTurn) != 2 || sum.RequestsByTurn[0] != 3 || sum.RequestsByTurn[1] != 3 {
				t.Errorf("by turn %v %v", sum.TTFTMsByTurn, sum.RequestsByTurn)
			}

			statsPath, sumPath, svgPath, outPath := filepath.Join(dir, name+"-stats.json"), filepath.Join(dir, name+".json"), filepath.Join(dir, name+".svg"), filepath.Join(dir, name+"-out.json")
			if err := WriteStatsJSON(statsPath, res.Samples); err != nil {
				t.Fatal(err)
			}
			var stats []map[string]any
			mustJSON(t, statsPath, &stats)
			if len(stats) != 6 || stats[0]["ttft_ms"] == nil || stats[0]["approx_cached_percent"] == nil || stats[0]["conversation_id"] == nil {
				t.Errorf("stats json: %v", stats)
			}
			if err := WriteSummaryJSON(sumPath, sum); err != nil {
				t.Fatal(err)
			}
			var raw map[string]any
			mustJSON(t, sumPath, &raw)
			for _, k := range []string{"metrics", "ttft_ms_by_turn", "runtime_sec", "requests_per_sec", "parameters"} {
				if raw[k] == nil {
					t.Errorf("summary json lacks %q", k)
				}
			}
			if err := WriteTTFTChartFile(svgPath, "TTFT per turn", []string{"tiny"}, sum); err != nil {
				t.Fatal(err)
			}
			svg, _ := os.ReadFile(svgPath)
			dec := xml.NewDecoder(bytes.NewReader(svg))
			for {
				if _, err := dec.Token(); err == io.EOF {
					break
				} else if err != nil {
					t.Fatalf("svg: %v", err)
				}
			}
			if err := WriteConversations(outPath, res.Conversations); err != nil {
				t.Fatal(err)
			}
			data, _ := os.ReadFile(outPath)
			back, err := ParseShareGPT(data)
			if err != nil || len(back) != 3 {
				t.Errorf("output file does not parse back as ShareGPT: %v", err)
			}
		})
	}
}

func mustJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
