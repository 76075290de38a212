package connector

import "time"

// quietInterval is how often a log line a remote client can trigger at will may be repeated
// (vLLM's stats interval).
const quietInterval = 10 * time.Second

// logLimiter lets one log line of each kind through per quietInterval and counts the ones it
// held back, so that a flood of bad notifications or params costs bounded log volume. The zero
// value is ready to use. Not safe for concurrent use (the core's, used under the Connector's
// mutex).
type logLimiter struct {
	last       map[string]time.Time
	suppressed map[string]int
}

// allow reports whether a line of kind may be logged at now, and how many were held back since
// the last one that was.
func (l *logLimiter) allow(kind string, now time.Time) (ok bool, suppressed int) {
	if l.last == nil {
		l.last, l.suppressed = map[string]time.Time{}, map[string]int{}
	}
	if last, seen := l.last[kind]; seen && now.Sub(last) < quietInterval {
		l.suppressed[kind]++
		return false, 0
	}
	l.last[kind] = now
	n := l.suppressed[kind]
	l.suppressed[kind] = 0
	return true, n
}
