package engine

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// planText renders a plan as the golden traces of testdata/scheduler show it: the token count,
// one line per Work, then the preempted and released requests. It prints every field of Plan and
// of Work (TestPlanTextCoversEveryField fails when one is left out). A Work's tokens are shown by
// their range [Start, Start+len(Tokens)): the harness checks that they are the request's tokens
// at those positions.
func planText(p Plan) string {
	var b strings.Builder
	fmt.Fprintf(&b, "plan: %s\n", plural(p.NumTokens, "token"))
	for _, w := range p.Work {
		fmt.Fprintf(&b, "  %s\n", workText(w))
	}
	if len(p.Preempted) > 0 {
		ids := make([]string, len(p.Preempted))
		for i, q := range p.Preempted {
			ids[i] = q.ID()
		}
		fmt.Fprintf(&b, "  preempted: %s\n", strings.Join(ids, " "))
	}
	if len(p.Released) > 0 {
		fmt.Fprintf(&b, "  released: %s\n", strings.Join(p.Released, " "))
	}
	return b.String()
}

// plural returns "1 token", "2 tokens".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// workText renders one Work: its request, what kind of work it is (a decode computes an output
// token; a prefill the prompt, or after a preemption the prompt and the output so far; a
// prefill chunk stops short of the request's last token), the positions computed, whether a
// token is sampled and the block table.
func workText(w Work) string {
	end := w.Start + len(w.Tokens)
	kind := "prefill"
	switch {
	case w.Start >= w.Seq.NumPromptTokens():
		kind = "decode"
	case !w.Sample:
		kind = "prefill-chunk"
	}
	sample := ""
	if w.Sample {
		sample = " sample"
	}
	return fmt.Sprintf("%s %s [%d,%d)%s blocks=%v", w.Seq.ID(), kind, w.Start, end, sample, w.Blocks)
}

// TestPlanTextCoversEveryField changes each field of Plan and of Work in turn, by reflection, and
// fails if planText prints the same text: a field added to either struct must be added to the
// traces' text.
func TestPlanTextCoversEveryField(t *testing.T) {
	q := &Sequence{id: "q", tokens: seqTokens(0, 8), numPrompt: 6}
	other := &Sequence{id: "other", tokens: seqTokens(1, 8), numPrompt: 6}
	basePlan := func() Plan { return Plan{Work: []Work{{Seq: q}}} }
	want := planText(basePlan())

	pt := reflect.TypeFor[Plan]()
	for i := range pt.NumField() {
		p := basePlan()
		setNonZero(t, reflect.ValueOf(&p).Elem().Field(i), "Plan."+pt.Field(i).Name, other)
		if planText(p) == want {
			t.Errorf("planText does not print Plan.%s", pt.Field(i).Name)
		}
	}
	wt := reflect.TypeFor[Work]()
	for i := range wt.NumField() {
		p := basePlan()
		setNonZero(t, reflect.ValueOf(&p.Work[0]).Elem().Field(i), "Work."+wt.Field(i).Name, other)
		if planText(p) == want {
			t.Errorf("planText does not print Work.%s", wt.Field(i).Name)
		}
	}
}

// setNonZero gives v (named name) a value other than zero; sequences become seq.
func setNonZero(t *testing.T, v reflect.Value, name string, seq *Sequence) {
	t.Helper()
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(3)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(3)
	case reflect.Bool:
		v.SetBool(true)
	case reflect.String:
		v.SetString("x")
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		setNonZero(t, v.Index(0), name+"[0]", seq)
	case reflect.Pointer:
		if v.Type() != reflect.TypeFor[*Sequence]() {
			t.Fatalf("%s: setNonZero does not know %s: teach it", name, v.Type())
		}
		v.Set(reflect.ValueOf(seq))
	case reflect.Struct:
		for i := range v.NumField() {
			setNonZero(t, v.Field(i), name+"."+v.Type().Field(i).Name, seq)
		}
	default:
		t.Fatalf("%s: setNonZero does not know %s: teach it", name, v.Type())
	}
}
