// Package buildinfo reports the version of the running kvbridge binary from the module and VCS
// information the Go toolchain embeds in it.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package buildinfo

import (
	"runtime/debug"
	"strings"
)

// Version returns the binary's version: the main module's version when it was built from a
// tagged module ("v0.3.1"), else "0.0.0.dev" with the VCS revision and a dirty mark when the
// toolchain recorded them ("0.0.0.dev+g1a2b3c4d5e6f.dirty"), as Python packages spell
// development builds; "0.0.0.dev" when nothing is known.
func Version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "0.0.0.dev"
	}
	return version(bi)
}

// version derives Version from build information.
func version(bi *debug.BuildInfo) string {
	if v := bi.Main.Version; v != "" && v != "(devel)" && !strings.Contains(v, "+dirty") {
		return v
	}
	var rev string
	dirty := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	v := "0.0.0.dev"
	if rev != "" {
		v += "+g" + rev[:min(12, len(rev))]
		if dirty {
			v += ".dirty"
		}
	} else if mv := bi.Main.Version; mv != "" && mv != "(devel)" {
		v = mv
	}
	return v
}
