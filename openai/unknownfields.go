package openai

import (
	"encoding/json"
	"log/slog"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/kvbridge/kvbridge/metrics"
)

// Bounds of the unknown-field notices, whose names come from clients.
const (
	// unknownFieldsInterval is how often one unknown field name may be logged.
	unknownFieldsInterval = time.Minute
	// maxLoggedFields bounds the distinct names logged per interval (and remembered to be).
	maxLoggedFields = 64
	// maxFieldLabels bounds the distinct names that get their own metrics label; later ones
	// are counted as "other".
	maxFieldLabels = 32
	// maxListedFields bounds the names one log line lists.
	maxListedFields = 16
	// maxFieldNameBytes bounds a name as it is logged or labelled: a longer one is cut (in the
	// log) or counted as "other" (in the metrics), as is one that is not valid UTF-8, which a
	// metrics label cannot carry.
	maxFieldNameBytes = 64
)

// unknownFields notices request fields the API does not know and ignores: it logs them as vLLM
// does ("The following fields were present in the request but ignored: …"), each name at most
// once per unknownFieldsInterval, and counts them in kvbridge:request_unknown_fields_total. It
// is safe for concurrent use.
type unknownFields struct {
	log     *slog.Logger
	metrics *metrics.EngineMetrics

	mu     sync.Mutex
	known  map[reflect.Type]map[string]bool // the JSON names of a request type's fields
	since  time.Time                        // start of the current interval
	logged map[string]bool                  // names logged in the current interval
	labels map[string]bool                  // names that have their own metrics label
}

func newUnknownFields(log *slog.Logger, m *metrics.EngineMetrics) *unknownFields {
	return &unknownFields{log: log, metrics: m, known: map[reflect.Type]map[string]bool{},
		logged: map[string]bool{}, labels: map[string]bool{}}
}

// decode decodes a request body into v (decodeJSON) and notices the fields it ignored.
func (s *Server) decode(body []byte, v any) *APIError {
	if apiErr := decodeJSON(body, v); apiErr != nil {
		return apiErr
	}
	s.unknown.check(body, v)
	return nil
}

// check notices the top-level keys of body (a JSON object already decoded into v, a pointer to
// a request struct) that are no field of v.
func (u *unknownFields) check(body []byte, v any) {
	var names []string
	u.mu.Lock()
	known := u.fieldsOf(reflect.TypeOf(v).Elem())
	u.mu.Unlock()
	topLevelKeys(body, func(raw []byte) {
		name := jsonKey(raw)
		if !utf8.ValidString(name) || len(name) > maxFieldNameBytes {
			// Marked with "…": such a name is logged, never a label.
			name = strings.ToValidUTF8(name[:min(len(name), maxFieldNameBytes)], "\uFFFD") + "…"
		}
		if !known[name] && !slices.Contains(names, name) && len(names) < maxLoggedFields {
			names = append(names, name)
		}
	})
	if len(names) == 0 {
		return
	}
	now := time.Now()
	u.mu.Lock()
	if now.Sub(u.since) >= unknownFieldsInterval {
		u.since, u.logged = now, map[string]bool{}
	}
	var fresh []string
	for _, name := range names {
		if !u.logged[name] && len(u.logged) < maxLoggedFields {
			u.logged[name] = true
			fresh = append(fresh, name)
		}
		label := name
		if !u.labels[name] {
			if len(u.labels) >= maxFieldLabels || strings.HasSuffix(name, "…") {
				label = "other"
			} else {
				u.labels[name] = true
			}
		}
		u.metrics.CountUnknownField(label)
	}
	u.mu.Unlock()
	if len(fresh) > 0 {
		more := ""
		if len(fresh) > maxListedFields {
			more = " and more"
			fresh = fresh[:maxListedFields]
		}
		u.log.Warn("The following fields were present in the request but ignored: {" + quoteAll(fresh) + more + "}")
	}
}

// quoteAll lists names as Python prints a set of strings: 'a', 'b'.
func quoteAll(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = "'" + strings.ReplaceAll(n, "'", `\'`) + "'"
	}
	return strings.Join(q, ", ")
}

// fieldsOf returns the JSON names of struct type t's fields, embedded structs' included. The
// caller holds u.mu.
func (u *unknownFields) fieldsOf(t reflect.Type) map[string]bool {
	if k, ok := u.known[t]; ok {
		return k
	}
	k := map[string]bool{}
	var add func(reflect.Type)
	add = func(t reflect.Type) {
		for i := range t.NumField() {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			switch {
			case f.Anonymous && name == "":
				add(f.Type)
			case name == "-":
			case name != "":
				k[name] = true
			default:
				k[f.Name] = true
			}
		}
	}
	add(t)
	u.known[t] = k
	return k
}

// jsonKey returns the text of a raw JSON string.
func jsonKey(raw []byte) string {
	if !slices.Contains(raw, '\\') {
		return string(raw[1 : len(raw)-1])
	}
	var s string
	_ = json.Unmarshal(raw, &s) // raw is a string of a valid document
	return s
}

// topLevelKeys calls fn with every key (raw, with its quotes) of the JSON object body, which
// must be valid JSON; it skips the values without decoding them.
func topLevelKeys(body []byte, fn func(raw []byte)) {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return
	}
	i++
	for {
		i = skipSpace(body, i)
		if i >= len(body) || body[i] != '"' {
			return // "}"
		}
		end := stringEnd(body, i)
		fn(body[i:end])
		i = skipSpace(body, end) + 1 // past ':'
		i = skipSpace(body, valueEnd(body, skipSpace(body, i)))
		if i >= len(body) || body[i] != ',' {
			return
		}
		i++
	}
}

// skipSpace returns the index of the first non-space byte of b at or after i.
func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringEnd returns the index just past the JSON string starting at b[i] (a quote).
func stringEnd(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(b)
}

// valueEnd returns the index just past the JSON value starting at b[i].
func valueEnd(b []byte, i int) int {
	if i >= len(b) {
		return i
	}
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = stringEnd(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	}
	for i < len(b) && b[i] != ',' && b[i] != '}' && b[i] != ']' && b[i] != ' ' && b[i] != '\t' && b[i] != '\n' && b[i] != '\r' {
		i++
	}
	return i
}
