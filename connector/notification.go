package connector

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// The notifications a reader sends the owner of the blocks it reads, over the transfer engine.
// vLLM sends "<request id>:<readers>" and "HB:<request id>,…"; kvbridge's carry the lease
// token instead of (heartbeats) or beside (completions) the request id, so that nobody but the
// holder of the params can end or extend another request's lease.

// HeartbeatPrefix starts a heartbeat notification: "HB:" followed by comma-joined lease tokens.
const HeartbeatPrefix = "HB:"

// FormatHeartbeat renders the heartbeat message for lease tokens (hex).
func FormatHeartbeat(tokens []string) string { return HeartbeatPrefix + strings.Join(tokens, ",") }

// ParseHeartbeat returns the tokens of a heartbeat message, and false if msg is not a heartbeat.
func ParseHeartbeat(msg string) ([]string, bool) {
	rest, ok := strings.CutPrefix(msg, HeartbeatPrefix)
	if !ok {
		return nil, false
	}
	if rest == "" {
		return nil, true
	}
	return strings.Split(rest, ","), true
}

// FormatRelease renders the notification that one of readers readers is done with the blocks
// leased to request id under token: "<id>:<readers>:<token>".
func FormatRelease(id string, readers int, token LeaseToken) string {
	return id + ":" + strconv.Itoa(readers) + ":" + token.String()
}

// errNotification reports a notification that is neither a heartbeat nor a release.
var errNotification = errors.New("malformed KV notification")

// ParseRelease parses "<id>:<readers>:<token>"; the id may itself contain colons.
func ParseRelease(msg string) (id string, readers int, token LeaseToken, err error) {
	rest, tok, ok := cutLast(msg, ':')
	if !ok {
		return "", 0, token, fmt.Errorf("%w: no lease token", errNotification)
	}
	if token, err = ParseLeaseToken(tok); err != nil {
		return "", 0, token, fmt.Errorf("%w: %v", errNotification, err)
	}
	id, n, ok := cutLast(rest, ':')
	if !ok || id == "" {
		return "", 0, token, fmt.Errorf("%w: no request id", errNotification)
	}
	if readers, err = strconv.Atoi(n); err != nil || readers < 1 {
		return "", 0, token, fmt.Errorf("%w: readers %q", errNotification, n)
	}
	return id, readers, token, nil
}

// cutLast splits s around the last sep.
func cutLast(s string, sep byte) (before, after string, found bool) {
	i := strings.LastIndexByte(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}
