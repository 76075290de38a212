package connector

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/kvlease"
)

// The text form of actions and the merge of several events' actions, both by reflection over
// every field of actions: a field that either does not know fails the test, so a field added to
// actions is never silently left out of the core's tests and traces.

// field returns the i-th field of the addressable struct v, readable and settable although it
// is unexported (tests only).
func field(v reflect.Value, i int) reflect.Value {
	f := v.Field(i)
	return reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem()
}

// mergeActions appends src's actions to dst's: slices are appended, maps merged, counts added.
func mergeActions(t testing.TB, dst *actions, src actions) {
	t.Helper()
	d, s := reflect.ValueOf(dst).Elem(), reflect.ValueOf(&src).Elem()
	for i := range d.NumField() {
		df, sf := field(d, i), field(s, i)
		switch df.Kind() {
		case reflect.Slice:
			df.Set(reflect.AppendSlice(df, sf))
		case reflect.Map:
			if sf.Len() > 0 && df.IsNil() {
				df.Set(reflect.MakeMap(df.Type()))
			}
			for it := sf.MapRange(); it.Next(); {
				df.SetMapIndex(it.Key(), it.Value())
			}
		case reflect.Int, reflect.Int64:
			df.SetInt(df.Int() + sf.Int())
		default:
			t.Fatalf("mergeActions: field actions.%s of kind %s has no merge", d.Type().Field(i).Name, df.Kind())
		}
	}
}

// actionsText renders a, one line per action, in the order of actions' fields (the order the
// worker performs them): "<field>: <action>". Empty fields print nothing.
func actionsText(t testing.TB, a actions) string {
	t.Helper()
	var b strings.Builder
	v := reflect.ValueOf(&a).Elem()
	for i := range v.NumField() {
		name, f := v.Type().Field(i).Name, field(v, i)
		var items []string
		switch f.Kind() {
		case reflect.Slice:
			for j := range f.Len() {
				items = append(items, actionText(t, name, f.Index(j).Interface()))
			}
		case reflect.Map:
			label := " first-bad="
			if name == "first" {
				label = " token "
			}
			for it := f.MapRange(); it.Next(); {
				items = append(items, actionText(t, name, it.Key().Interface())+label+actionText(t, name, it.Value().Interface()))
			}
			slices.Sort(items)
		default:
			if !f.IsZero() {
				items = append(items, actionText(t, name, f.Interface()))
			}
		}
		for _, it := range items {
			fmt.Fprintf(&b, "%s: %s\n", name, it)
		}
	}
	return b.String()
}

// actionText renders one action of field name.
func actionText(t testing.TB, name string, v any) string {
	t.Helper()
	switch v := v.(type) {
	case string:
		return v
	case int:
		return fmt.Sprint(v)
	case time.Duration:
		return v.String()
	case handshakeJob:
		return v.key.String() + " at " + v.addr
	case *remoteLink:
		return fmt.Sprintf("%s (%s#%d)", v.key, v.peer, v.peerInc)
	case beat:
		return v.peer + " " + string(v.msg)
	case notice:
		return fmt.Sprintf("to %s/%s: %s", v.params.RemoteEngineID, v.params.RemoteRequestID, releaseText(string(v.msg)))
	case loadJob:
		s := fmt.Sprintf("%s from %s/%s tokens [%d,%d) blocks %v", v.id, v.params.RemoteEngineID, v.params.RemoteRequestID,
			v.localHit, v.localHit+v.count, v.blocks)
		if v.fromD {
			s += " from-decoder"
		}
		if v.awaiting {
			s += " awaits " + v.handshake.key.String()
		}
		if v.handshakeErr != nil {
			s += fmt.Sprintf(" handshake-failed %q", v.handshakeErr)
		}
		return s + ", carries " + releaseText(string(v.release))
	case registerJob:
		return registerText(t, v)
	case pushJob:
		local, remote := pushTail(v, coreBlockSize)
		s := fmt.Sprintf("%s into %s/%s from %s#%d: blocks %v -> %v, %d tokens", v.id, v.reg.EngineID, v.reg.RequestID, v.peer, v.peerInc, local, remote, v.numTokens)
		if v.reg.FirstToken && v.first != nil {
			s += fmt.Sprintf(", first token %d (%d draws)", v.first.token, v.first.draws)
		}
		return s
	case engine.FirstToken:
		return fmt.Sprintf("%d (%d draws)", v.Token, v.Draws)
	case pushNotice:
		var done pushCompletion
		if err := decodePush(strings.TrimPrefix(string(v.msg), pushDonePrefix), &done); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("to %s: %s failed: %s", v.peer, done.RequestID, done.Error)
	}
	t.Fatalf("actionText: actions.%s holds a %T, which has no text form: add one", name, v)
	return ""
}

// registerText renders a registration as what it names.
func registerText(t testing.TB, j registerJob) string {
	t.Helper()
	var reg pushRegistration
	if err := decodePush(strings.TrimPrefix(string(j.msg), pushRegPrefix), &reg); err != nil {
		t.Fatal(err)
	}
	target := "request " + reg.RemoteRequestID
	if reg.PushID != "" {
		target = "push_id " + reg.PushID
	}
	s := fmt.Sprintf("%s to %s for %s: blocks %v from block %d, %d tokens", j.id, j.params.RemoteEngineID, target, reg.BlockIDs, reg.FirstBlock, reg.NumTokens)
	if j.cancel {
		s = fmt.Sprintf("%s to %s for %s: cancel, %d tokens", j.id, j.params.RemoteEngineID, target, reg.NumTokens)
	}
	if reg.FirstToken {
		s += ", asks for the first token"
	}
	if j.awaiting {
		s += " awaits " + j.handshake.key.String()
	}
	return s
}

// releaseText renders a release notification as what it says: the request, the readers and how
// many tokens it proves (the token and the proof are hex noise in a trace).
func releaseText(msg string) string {
	r, err := kvlease.ParseRelease(msg)
	if err != nil {
		return fmt.Sprintf("malformed release %q", msg)
	}
	return fmt.Sprintf("release %s readers=%d token=%s proven=%d", r.ID, r.Readers, shortToken(r.Token), r.Proven)
}

// shortToken is the first 8 hex digits of a lease token.
func shortToken(t kvlease.Token) string { return t.String()[:8] }

// TestActionsTextCoversEveryField: every field of actions, set, shows in its text form and
// survives a merge; an empty value prints nothing.
func TestActionsTextCoversEveryField(t *testing.T) {
	p := &Params{RemoteEngineID: "P", RemoteRequestID: "p1"}
	rel := kvlease.FormatRelease(kvlease.Release{ID: "p1", Readers: 1, Token: kvlease.Token{1}, Proven: 4})
	link := &remoteLink{key: remoteKey{"P", "i"}, peer: "kvbridge-P", peerInc: 1}
	full := actions{
		handshakes:   []handshakeJob{{remoteKey{"P", "i"}, "h:1"}},
		loads:        []loadJob{{id: "d1", params: p, count: 4, release: []byte(rel)}},
		notifies:     []notice{{p, []byte(rel)}},
		beats:        []beat{{"kvbridge-P", []byte("HB:01"), 1}},
		drops:        []*remoteLink{link},
		release:      []string{"p1"},
		loaded:       []string{"d1"},
		first:        map[string]engine.FirstToken{"d1": {Token: 7, Draws: 1}},
		failed:       map[string]int{"d2": 1},
		missed:       []string{"d3"},
		holdsExpired: 2,
		holdsSince:   time.Second,
		registers:    []registerJob{{id: "d1", params: p, msg: encodePush(pushRegPrefix, pushRegistration{PushID: "x", BlockIDs: []int32{1}})}},
		pushes:       []pushJob{{id: "p1", reg: pushRegistration{RequestID: "d1", BlockIDs: []int32{4}}, blocks: []int32{0}, numTokens: 3}},
		pushNotices:  []pushNotice{{peer: "kvbridge-D", msg: encodePush(pushDonePrefix, pushCompletion{RequestID: "d1", Error: "no"})}},
	}
	for i := range reflect.ValueOf(full).NumField() {
		if f := reflect.ValueOf(full).Field(i); f.IsZero() {
			t.Fatalf("set actions.%s in this test", reflect.TypeOf(full).Field(i).Name)
		}
	}
	if got := actionsText(t, actions{}); got != "" {
		t.Fatalf("empty actions print %q", got)
	}
	var merged actions
	mergeActions(t, &merged, full)
	text := actionsText(t, merged)
	v := reflect.ValueOf(full)
	for i := range v.NumField() {
		if name := v.Type().Field(i).Name; !strings.Contains(text, name+": ") {
			t.Errorf("actions.%s is not in the text form:\n%s", name, text)
		}
	}
}

// TestHookActionsCheck: the check every hook of the core's tests goes through refuses the
// synchronous actions and passes the others.
func TestHookActionsCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		a    actions
		ok   bool
	}{
		{"asynchronous", actions{handshakes: []handshakeJob{{}}, loads: []loadJob{{}}, notifies: []notice{{}}, release: []string{"r"}}, true},
		{"a beat", actions{beats: []beat{{peer: "p"}}}, false},
		{"a drop", actions{drops: []*remoteLink{{}}}, false},
	} {
		if err := hookActions(tc.a); (err == nil) != tc.ok {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}
