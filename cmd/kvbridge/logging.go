package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/pflag"
)

// logLevelEnv is vLLM's logging level variable; --log-level wins over it.
const logLevelEnv = "VLLM_LOGGING_LEVEL"

// logFlags are --log-level and --log-format, shared by the long-running commands (serve,
// proxy).
type logFlags struct {
	level, format string
	changed       func(string) bool // whether --log-level was given; set by register
}

// register adds the flags to fl.
func (lf *logFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&lf.level, "log-level", "info", "least severe log lines printed: debug, info, warning or error (env "+logLevelEnv+", as vLLM reads it; the flag wins)")
	fl.StringVar(&lf.format, "log-format", "text", "log line format: text (key=value) or json (one object a line)")
	lf.changed = fl.Changed
}

// logger returns the logger the flags ask for, writing to w, or a usage error naming the bad
// flag (or variable).
func (lf logFlags) logger(w io.Writer) (*slog.Logger, error) {
	name, value := "--log-level", cmp.Or(lf.level, "info")
	if (lf.changed == nil || !lf.changed("log-level")) && os.Getenv(logLevelEnv) != "" {
		name, value = logLevelEnv, os.Getenv(logLevelEnv)
	}
	level, err := parseLogLevel(value)
	if err != nil {
		return nil, usageError("%s %q: %v", name, value, err)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch cmp.Or(lf.format, "text") {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, usageError("--log-format %q: want text or json", lf.format)
}

// parseLogLevel reads a level as vLLM reads VLLM_LOGGING_LEVEL (Python's level names, any
// case): DEBUG, INFO, WARNING (or WARN), ERROR, and CRITICAL (or FATAL), which slog has not and
// which means ERROR here.
func parseLogLevel(s string) (slog.Level, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "DEBUG":
		return slog.LevelDebug, nil
	case "INFO":
		return slog.LevelInfo, nil
	case "WARNING", "WARN":
		return slog.LevelWarn, nil
	case "ERROR", "CRITICAL", "FATAL":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("want debug, info, warning or error")
}

// redisLogger sends go-redis's log lines (a dial that failed, a pool that gave up) through the
// command's slog logger at warning level, instead of the unstructured lines go-redis prints to
// stderr by default.
type redisLogger struct{ log *slog.Logger }

// Printf implements go-redis's internal.Logging.
func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: "), "component", "go-redis")
}

// routeRedisLogs makes go-redis log through log. go-redis v9 has one logger for the whole
// process (redis.SetLogger; its Options have none), so the command sets it once, here, rather
// than the proxy package on every store it opens: a library that changed process-wide state
// would make two proxies in one process (tests, stacks) overwrite each other's logger.
func routeRedisLogs(log *slog.Logger) { redis.SetLogger(redisLogger{log}) }
