package connector

import (
	"io"
	"log/slog"
)

func testLogger(w io.Writer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }
