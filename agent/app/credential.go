package app

import (
	"context"
	"io"
	"os"
	"time"

	"github.com/go-logr/logr"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/textlogger"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/credential"
)

func newCredentialCommand(stdout, stderr io.Writer) *cobra.Command {
	o, logs := &nodeOptions{}, &logFlags{}
	cmd := &cobra.Command{
		Use:   "credential",
		Short: "Exec credential plugin: print kubelet's client certificate as an ExecCredential",
		Long: `credential is the client-go exec credential plugin (client.authentication.k8s.io/v1)
named in kubelet's kubeconfig. It prints only the ExecCredential JSON on
stdout.

When the cached certificate is fresh it is returned at once. Otherwise the
command takes the cache lock, attests, files a certificate signing request
with the bootstrap credential (or, to renew, with the current certificate),
waits for the signer (bounded by --timeout), stores the key and certificate
(0600) and returns them. A failed renewal keeps a still-valid certificate.

kubeconfig user entry:

  exec:
    apiVersion: client.authentication.k8s.io/v1
    command: /usr/local/bin/kubelet-authenticator
    args: ["credential"]
    interactiveMode: Never
    provideClusterInfo: true`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			info, err := credential.ExecInfo(os.Getenv("KUBERNETES_EXEC_INFO"))
			if err != nil {
				return err
			}
			cfg, err := o.Complete()
			if err != nil {
				return err
			}
			call := &credentialCall{cfg: cfg, info: info, logLevel: logs.effective()}
			return call.run(cmd.Context(), stdout, stderr, time.Now())
		},
	}
	addCredentialFlags(cmd.Flags(), o, logs)
	return cmd
}

// logFlags are the credential command's log settings: -v, the log level
// as everywhere else (kubectl, Cluster API, the agent), and --verbose, the
// older spelling of -v=1.
type logFlags struct {
	level   int
	verbose bool
}

// effective is the log level the flags ask for: 0 logs nothing, 1 or more
// logs the call's progress.
func (l *logFlags) effective() int {
	if l.verbose {
		return max(l.level, 1)
	}
	return l.level
}

func addCredentialFlags(fs *pflag.FlagSet, o *nodeOptions, logs *logFlags) {
	o.AddFlags(fs)
	fs.IntVarP(&logs.level, "v", "v", 0,
		"log level: 1 or more logs progress (attestation, CSR name, signer decision) on stderr; at 0 a failure is one line and success prints nothing there")
	fs.BoolVar(&logs.verbose, "verbose", false, "the same as -v=1")
	_ = fs.MarkDeprecated("verbose", "use -v=1")
}

// answerFromCache is the path kubelet takes most: a fresh cached
// certificate, answered from the cache file's header; no X.509 parsing, no
// attestor, no lock, no network.
func answerFromCache(cfg *config.NodeConfig, apiVersion string, now time.Time) ([]byte, bool) {
	certPEM, keyPEM, expires, ok := cache.Dir{Path: cfg.CacheDir}.Fresh(cfg.NodeName, now)
	if !ok {
		return nil, false
	}
	out, err := credential.MarshalPEM(apiVersion, certPEM, keyPEM, expires)
	return out, err == nil
}

// credentialCall is one run of the credential command, its flags, exec
// info and configuration resolved.
type credentialCall struct {
	cfg      *config.NodeConfig
	info     *clientauthv1.ExecCredential
	logLevel int
}

// parseCredentialCall resolves `credential` args and the exec info the
// way the credential command does (the same flags, the same config loader
// and checks), so that Main can run the call before building the command
// tree: kubelet's most frequent call, a fresh cache, then costs no more
// than that, and a cold call loads its configuration once. false (not a
// credential call, or anything unusual or invalid) leaves the call to the
// command, which reports what is wrong.
func parseCredentialCall(args []string, execInfo string) (*credentialCall, bool) {
	if len(args) == 0 || args[0] != "credential" {
		return nil, false
	}
	fs := pflag.NewFlagSet("credential", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o, logs := &nodeOptions{}, &logFlags{}
	addCredentialFlags(fs, o, logs)
	if err := fs.Parse(args[1:]); err != nil || fs.NArg() != 0 {
		return nil, false
	}
	info, err := credential.ExecInfo(execInfo)
	if err != nil {
		return nil, false
	}
	cfg, err := o.Complete()
	if err != nil {
		return nil, false
	}
	return &credentialCall{cfg: cfg, info: info, logLevel: logs.effective()}, true
}

func (c *credentialCall) apiVersion() string {
	if c.info == nil {
		return ""
	}
	return c.info.APIVersion
}

// run prints the credential: from a fresh cache at once; otherwise the
// cache lock, attestation, the CSR and the wait.
func (c *credentialCall) run(ctx context.Context, stdout, stderr io.Writer, now time.Time) error {
	if out, ok := answerFromCache(c.cfg, c.apiVersion(), now); ok {
		_, err := stdout.Write(out)
		return err
	}
	ctx = klog.NewContext(ctx, c.logger(stderr))
	src := &credential.Source{Config: c.cfg}
	if c.info != nil {
		src.Cluster = c.info.Spec.Cluster
	}
	var err error
	if src.Attestor, err = newAttestor(c.cfg); err != nil {
		return err
	}
	// Get looks at the cache again, under the lock, and renews only if it
	// must.
	cred, expires, err := src.Get(ctx)
	if err != nil {
		return err
	}
	out, err := credential.Marshal(c.apiVersion(), cred, expires)
	if err != nil {
		return err
	}
	_, err = stdout.Write(out)
	return err
}

// logger is the call's log: at log level 1 or more, one line a step on
// stderr in klog's text format (a header, the message, key="value" pairs),
// as kubelet, whose journal it lands in, writes its own; at 0 nothing, so
// that a failure is the one line Main prints. stdout carries only the
// ExecCredential.
func (c *credentialCall) logger(stderr io.Writer) logr.Logger {
	if c.logLevel <= 0 {
		return logr.Discard()
	}
	cfg := textlogger.NewConfig(textlogger.Output(stderr), textlogger.Verbosity(c.logLevel))
	return textlogger.NewLogger(cfg).WithName("kubelet-authenticator")
}
