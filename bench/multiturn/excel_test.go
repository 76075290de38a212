package multiturn

import (
	"bytes"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/xuri/excelize/v2"
)

// TestVerbosePrintContentAndExcel: -v reports each client's choices, --print-content the
// messages and answers, and -e writes a workbook with vLLM's two sheets: the summary blocks at
// pandas' rows and one raw row per request, sorted by start time, with
// time_between_user_turns_sec under -v.
func TestVerbosePrintContentAndExcel(t *testing.T) {
	url := startFake(t, &fakeChat{})
	var progress, content bytes.Buffer
	tc := EstimateTokenCounter("test")
	opts := Options{URL: url, Model: "m", Tokens: tc, NumClients: 2, MaxActiveConversations: 2, Verbose: true, Content: &content, Progress: &progress}
	res, err := Run(t.Context(), convs(3, 2), opts)
	if err != nil || len(res.Samples) == 0 {
		t.Fatalf("run: %v, %d samples", err, len(res.Samples))
	}
	for _, want := range []string{"will use conversation ID c0", "using conversation ID c1 (turn: 1)", "finished conversation ID"} {
		if !strings.Contains(progress.String(), want) {
			t.Errorf("verbose log lacks %q:\n%s", want, progress.String())
		}
	}
	for _, want := range []string{`Messages (conversation ID c0, 1 turns): [{"role":"user","content":"c0 question 1"}]`, "Response (", "answer c0 1"} {
		if !strings.Contains(content.String(), want) {
			t.Errorf("printed content lacks %q:\n%s", want, content.String())
		}
	}

	sum := Summarize(res, ReportInfo{Model: "m", Options: opts, WarmupPercentages: []float64{0, 0.5}})
	name := ExcelFileName(2, time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC))
	if name != "statistics_2_clients__04-03-2026_05-06-07.xlsx" {
		t.Errorf("file name %q", name)
	}
	path := filepath.Join(t.TempDir(), name)
	if err := WriteExcel(path, sum, res.Samples, true); err != nil {
		t.Fatal(err)
	}
	f, err := excelize.OpenFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := f.GetSheetList(); strings.Join(got, ",") != "Summary,Raw data" {
		t.Errorf("sheets %v", got)
	}
	cell := func(sheet, c string) string {
		v, err := f.GetCellValue(sheet, c)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	// Parameters in rows 1–2; no generation parameters, so the first window's runtime block in
	// rows 5–6 and its describe() table from row 8 (pandas' startrow arithmetic).
	if cell("Summary", "A1") != "model" || cell("Summary", "A2") != "m" || cell("Summary", "B2") != "2" ||
		cell("Summary", "A5") != "runtime_sec" || cell("Summary", "B8") != "count" || cell("Summary", "A9") != "ttft_ms" ||
		cell("Summary", "B9") != strconv.Itoa(len(res.Samples)) {
		rows, _ := f.GetRows("Summary")
		t.Errorf("summary sheet:\n%v", rows)
	}
	// The second window (50 % warm-up) follows after the 7 metrics and 3 blank rows.
	if cell("Summary", "A19") != "runtime_sec" || cell("Summary", "A23") != "ttft_ms" {
		rows, _ := f.GetRows("Summary")
		t.Errorf("second window:\n%v", rows)
	}
	rows, err := f.GetRows("Raw data")
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != len(res.Samples)+1 || rows[0][0] != "ttft_ms" || rows[0][12] != "time_between_user_turns_sec" || rows[0][13] != "end_time_ms" {
		t.Fatalf("raw data header %v, %d rows", rows[0], len(rows))
	}
	prev := -1.0
	for _, r := range rows[1:] {
		start, _ := strconv.ParseFloat(r[3], 64)
		if start < prev {
			t.Errorf("raw data not sorted by start_time_ms: %v after %v", start, prev)
		}
		prev = start
	}
}
