package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestVersion(t *testing.T) {
	rev := []debug.BuildSetting{{Key: "vcs.revision", Value: "1a2b3c4d5e6f7a8b9c0d"}, {Key: "vcs.modified", Value: "true"}}
	cases := []struct {
		main string
		set  []debug.BuildSetting
		want string
	}{
		{"v0.3.1", nil, "v0.3.1"},
		{"(devel)", rev, "0.0.0.dev+g1a2b3c4d5e6f.dirty"},
		{"(devel)", rev[:1], "0.0.0.dev+g1a2b3c4d5e6f"},
		{"", nil, "0.0.0.dev"},
		{"v0.3.2-0.20260101000000-1a2b3c4d5e6f+dirty", nil, "v0.3.2-0.20260101000000-1a2b3c4d5e6f+dirty"},
	}
	for _, c := range cases {
		bi := &debug.BuildInfo{Main: debug.Module{Version: c.main}, Settings: c.set}
		if got := version(bi); got != c.want {
			t.Errorf("version(%q, %v) = %q, want %q", c.main, c.set, got, c.want)
		}
	}
	if Version() == "" {
		t.Error("Version() is empty")
	}
}
