package kubernetes_test

import (
	"context"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// workload is a StatefulSet or Deployment of a manifest set: its name, replicas and pods.
type workload struct {
	name     string
	replicas int32
	pods     *corev1.PodTemplateSpec
}

// workloads returns every StatefulSet and Deployment, by name.
func workloads(o *objects) map[string]workload {
	w := map[string]workload{}
	for name, s := range o.statefulSets {
		w[name] = workload{name, ptrOr(s.Spec.Replicas, 1), &s.Spec.Template}
	}
	for name, d := range o.deployments {
		w[name] = workload{name, ptrOr(d.Spec.Replicas, 1), &d.Spec.Template}
	}
	return w
}

func ptrOr(p *int32, def int32) int32 {
	if p == nil {
		return def
	}
	return *p
}

// selected returns the names of the workloads whose pods sel matches; a nil or empty selector,
// or one with expressions this test does not evaluate, matches none.
func selected(ws map[string]workload, sel *metav1.LabelSelector) []string {
	var names []string
	if sel == nil || len(sel.MatchLabels) == 0 || len(sel.MatchExpressions) > 0 {
		return nil
	}
	for name, w := range ws {
		if labelsMatch(sel.MatchLabels, w.pods.Labels) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names
}

// checkDisruptionAndSpread checks that every workload has exactly one PodDisruptionBudget,
// selecting its pods and no other workload's and letting a drain proceed, and that every
// workload of several replicas prefers to spread them over nodes (pod anti-affinity against
// its own pods).
func checkDisruptionAndSpread(t *testing.T, o *objects) {
	t.Helper()
	ws := workloads(o)
	budgets := map[string][]string{}
	for name, pdb := range o.pdbs {
		sel := selected(ws, pdb.Spec.Selector)
		if len(sel) != 1 {
			t.Errorf("PodDisruptionBudget %s selects workloads %v, want exactly one", name, sel)
			continue
		}
		budgets[sel[0]] = append(budgets[sel[0]], name)
		if mu := pdb.Spec.MaxUnavailable; mu == nil || mu.IntValue() < 1 {
			t.Errorf("PodDisruptionBudget %s: maxUnavailable %v; want at least 1, or a drain of a node with its only pod never ends", name, mu)
		}
	}
	for name, w := range ws {
		if len(budgets[name]) != 1 {
			t.Errorf("%s: PodDisruptionBudgets %v, want one", name, budgets[name])
		}
		if w.replicas < 2 {
			continue
		}
		var spread bool
		if a := w.pods.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
			for _, term := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
				sel := selected(ws, term.PodAffinityTerm.LabelSelector)
				spread = spread || (slices.Equal(sel, []string{name}) && term.PodAffinityTerm.TopologyKey == corev1.LabelHostname)
			}
		}
		if !spread {
			t.Errorf("%s: %d replicas without a preferred pod anti-affinity against its own pods over %s", name, w.replicas, corev1.LabelHostname)
		}
	}
}

// checkLabels checks that every workload's selector matches its own pods, that every pod is
// labelled part of kvbridge, and that app.kubernetes.io/name says what runs: kvbridge for the
// kvbridge image, redis for Redis — so that a selector of kvbridge's pods never takes Redis in.
func checkLabels(t *testing.T, o *objects) {
	t.Helper()
	selectors := map[string]*metav1.LabelSelector{}
	for name, s := range o.statefulSets {
		selectors[name] = s.Spec.Selector
	}
	for name, d := range o.deployments {
		selectors[name] = d.Spec.Selector
	}
	for name, w := range workloads(o) {
		if sel := selectors[name]; sel == nil || len(sel.MatchLabels) == 0 || !labelsMatch(sel.MatchLabels, w.pods.Labels) {
			t.Errorf("%s: selector %v does not match its pods' labels %v", name, sel, w.pods.Labels)
		}
		l := w.pods.Labels
		if l["app.kubernetes.io/part-of"] != "kvbridge" {
			t.Errorf("%s: pods without app.kubernetes.io/part-of=kvbridge: %v", name, l)
		}
		image, _, _ := strings.Cut(w.pods.Spec.Containers[0].Image, ":")
		if want := filepath.Base(image); l["app.kubernetes.io/name"] != want {
			t.Errorf("%s: pods of image %s labelled app.kubernetes.io/name=%s, want %s", name, image, l["app.kubernetes.io/name"], want)
		}
	}
}

// portsOf returns the ports each workload listens on, by purpose, as its arguments and
// environment give them: "http" (--port), "side-channel" (VLLM_NIXL_SIDE_CHANNEL_PORT),
// "kv-transfer" (--kv-transfer-port), "redis" (the port the proxy's --conversation-store names).
func portsOf(t *testing.T, o *objects) map[string]map[string]int {
	t.Helper()
	out := map[string]map[string]int{}
	atoi := func(what, s string) int {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Errorf("%s %q is not a port", what, s)
		}
		return n
	}
	for name, s := range o.statefulSets {
		c, env := container(t, o, &s.Spec.Template)
		f := flags(expandArgs(t, c, env))
		out[name] = map[string]int{"http": atoi(name+" --port", f["port"]), "side-channel": atoi(name+" VLLM_NIXL_SIDE_CHANNEL_PORT", env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
			"kv-transfer": atoi(name+" --kv-transfer-port", f["kv-transfer-port"])}
	}
	if d := o.deployments["kvbridge-proxy"]; d != nil {
		c, env := container(t, o, &d.Spec.Template)
		f := flags(expandArgs(t, c, env))
		out["kvbridge-proxy"] = map[string]int{"http": atoi("proxy --port", f["port"])}
		if store := f["conversation-store"]; store != "" {
			u, err := url.Parse(store)
			if err != nil {
				t.Fatalf("proxy --conversation-store %q: %v", store, err)
			}
			svc := o.services[u.Hostname()]
			if svc == nil {
				t.Fatalf("proxy --conversation-store %s: no Service %s", store, u.Hostname())
			}
			sel := selected(workloads(o), &metav1.LabelSelector{MatchLabels: svc.Spec.Selector})
			if len(sel) != 1 {
				t.Fatalf("Service %s selects %v", svc.Name, sel)
			}
			out[sel[0]] = map[string]int{"redis": atoi("--conversation-store port", u.Port())}
		}
	}
	return out
}

// checkNetworkPolicies checks that every workload has a NetworkPolicy and that, together, they
// let in exactly: clients to the proxy's port; the proxy to each engine's HTTP port; the
// decoders to the prefillers' side channel and transfer ports (and, bidirectional, the
// prefillers to the decoders'); the proxy to Redis. Ports are compared with the ones the
// workloads' arguments and environment use.
func checkNetworkPolicies(t *testing.T, o *objects, bidi bool) {
	t.Helper()
	ws := workloads(o)
	ports := portsOf(t, o)
	const p, d, px, redis = "kvbridge-prefill", "kvbridge-decode", "kvbridge-proxy", "kvbridge-redis"
	// want[target][source] = the target's ports the source may reach; source "" is anyone.
	want := map[string]map[string][]int{
		p:  {px: {ports[p]["http"]}, d: {ports[p]["side-channel"], ports[p]["kv-transfer"]}},
		d:  {px: {ports[d]["http"]}},
		px: {"": {ports[px]["http"]}},
	}
	if bidi {
		want[d][p] = []int{ports[d]["side-channel"], ports[d]["kv-transfer"]}
		want[redis] = map[string][]int{px: {ports[redis]["redis"]}}
	}
	got := map[string]map[string][]int{}
	for name, np := range o.networkPolicies {
		target := selected(ws, &np.Spec.PodSelector)
		if len(target) != 1 {
			t.Errorf("NetworkPolicy %s applies to workloads %v, want exactly one", name, target)
			continue
		}
		if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
			t.Errorf("NetworkPolicy %s: policyTypes %v, want [Ingress]", name, np.Spec.PolicyTypes)
		}
		rules := map[string][]int{}
		got[target[0]] = rules
		for _, rule := range np.Spec.Ingress {
			var nums []int
			for _, port := range rule.Ports {
				if port.Port == nil || port.Port.String() != strconv.Itoa(port.Port.IntValue()) {
					t.Errorf("NetworkPolicy %s: port %v is not a number (name the ports the arguments give)", name, port.Port)
					continue
				}
				nums = append(nums, port.Port.IntValue())
			}
			sources := []string{""}
			if len(rule.From) > 0 {
				sources = nil
				for _, peer := range rule.From {
					sel := selected(ws, peer.PodSelector)
					if len(sel) != 1 || peer.NamespaceSelector != nil || peer.IPBlock != nil {
						t.Errorf("NetworkPolicy %s: a source that is not one workload of this namespace: %+v selects %v", name, peer, sel)
						continue
					}
					sources = append(sources, sel[0])
				}
			}
			for _, src := range sources {
				rules[src] = append(rules[src], nums...)
			}
		}
	}
	for _, m := range []map[string]map[string][]int{want, got} {
		for _, rules := range m {
			for _, ps := range rules {
				slices.Sort(ps)
			}
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("NetworkPolicies let in (target: source: ports)\n  %v\nwant\n  %v", got, want)
	}
	for name := range ws {
		if got[name] == nil {
			t.Errorf("%s: no NetworkPolicy", name)
		}
	}
}

// TestProbesAreServed: every HTTP probe of every overlay is a route kvbridge serves, asked of a
// real server of the kind the container runs (an engine with a connector; the proxy, one-way or
// multi-turn, in front of it), and answers 200 when all is up.
func TestProbesAreServed(t *testing.T) {
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	eng, err := instance.Start(t.Context(), instance.Config{OpenedModel: m, Host: "127.0.0.1", NumBlocks: 32, MaxModelLen: 256,
		KVTransfer: connector.DefaultConfig(connector.RoleProducer), SideChannelPort: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	engine, err := proxy.NewInstance("127.0.0.1", eng.Addr.Port)
	if err != nil {
		t.Fatal(err)
	}
	cfg := proxy.Config{Prefill: []proxy.Instance{engine}, Decode: []proxy.Instance{engine}}
	oneWay, err := proxy.NewOneWay(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { oneWay.Close() })
	multiTurn, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { multiTurn.Close() })

	ask := func(h http.Handler, path string) int {
		if h == nil {
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, eng.URL+path, nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec.Code
	}
	for _, dir := range slices.Sorted(maps.Keys(overlays)) {
		o := build(t, dir)
		for name, w := range workloads(o) {
			var server http.Handler // nil: the engine
			switch {
			case name == "kvbridge-redis":
				continue
			case name == "kvbridge-proxy" && overlays[dir]:
				server = multiTurn
			case name == "kvbridge-proxy":
				server = oneWay
			}
			c := &w.pods.Spec.Containers[0]
			for kind, pr := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
				if pr == nil || pr.HTTPGet == nil {
					continue
				}
				// The proxies' health waits for their probes of the engines (1 s each), an
				// engine's readiness for its side-channel check (2 s at most): Kubernetes'
				// default timeout of 1 s would fail them — and restart a proxy — exactly when an
				// engine hangs.
				if (server != nil || pr.HTTPGet.Path == "/ready") && pr.TimeoutSeconds < 3 {
					t.Errorf("%s %s: %s probe GET %s with timeoutSeconds %d; want at least 3", filepath.Base(dir), name, kind, pr.HTTPGet.Path, pr.TimeoutSeconds)
				}
				if code := ask(server, pr.HTTPGet.Path); code != http.StatusOK {
					t.Errorf("%s %s: %s probe GET %s answers %d with everything up; want 200", filepath.Base(dir), name, kind, pr.HTTPGet.Path, code)
				}
			}
		}
	}
}
